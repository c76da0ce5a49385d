"""Per-turn rewards through a real episode: with `rollout.env.reward = "per_turn"` each step's
reward sits on the last token of the model turn it follows, in the sample and in the train batch;
with `"per_turn_reward_fn"` `rollout.reward` — a rule, or a real embedded judge — scores each
turn instead, and its scores land on the same tokens."""

from __future__ import annotations

import asyncio

import pytest
import torch
from agentic_testkit import ScriptEngine, context

from verst.rollout.agentic import StepResult
from verst.rollout.agentic.turn_rewards import POSITIONS_KEY
from verst.rollout.config import JudgeConfig
from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.protocols import RolloutRequest
from verst.rollout.rewards.judge import EngineJudge, JudgeReward
from verst.rollout.sample import Sample, Status
from verst.rollout.strategies.inference import InferenceRollout
from verst.rollout.toy import make_tiny_checkpoint


class ThreeTurns:
    def __init__(self) -> None:
        self.n = 0

    async def reset(self, sample):
        return None

    async def step(self, turn) -> StepResult:
        self.n += 1
        if self.n == 3:
            return StepResult(done=True, reward=2.0)
        return StepResult(observation=f"[obs {self.n}]", reward=0.25 * self.n)

    async def close(self):
        pass


def test_per_turn_rewards_reach_each_model_turns_last_token():
    from verst.trainer.train.batch import build_train_batch

    ctx = context(
        ScriptEngine(lambda c, r: "go!"), prompts=["p:"], env={"type": "tools", "reward": "per_turn"}
    )
    strategy = InferenceRollout(ctx)
    strategy.generate_fn.factory = ThreeTurns
    s = asyncio.run(strategy(RolloutRequest(0))).groups[0][0]
    model_ends = [g["start"] + g["length"] - 1 for g in s.metadata["segments"] if g["source"] == "model"]
    assert s.metadata[POSITIONS_KEY] == [[e, r] for e, r in zip(model_ends, [0.25, 0.5, 2.0], strict=True)]
    assert s.reward == 2.75
    row = build_train_batch([[s]]).turn_rewards[0]
    assert {i: row[i].item() for i in row.nonzero().flatten().tolist()} == dict(
        zip(model_ends, [0.25, 0.5, 2.0], strict=True)
    )
    assert all(s.loss_mask[e] == 1 for e in model_ends)


def _replies(conversation: str, request) -> str:
    """Turn t answers t + 1 letters ("a", "bb", "ccc")."""
    t = conversation.count("[obs")
    return "abc"[t] * (t + 1)


def _per_turn_episode(reward_fn):
    ctx = context(
        ScriptEngine(_replies),
        prompts=["p:"],
        labels=["ref"],
        reward_fn=reward_fn,
        env={"type": "tools", "reward": "per_turn_reward_fn"},
    )
    strategy = InferenceRollout(ctx)
    strategy.generate_fn.factory = ThreeTurns
    result = asyncio.run(strategy(RolloutRequest(0)))
    return result, result.groups[0][0] if result.groups else None


def _model_ends(s) -> list[int]:
    return [g["start"] + g["length"] - 1 for g in s.metadata["segments"] if g["source"] == "model"]


def test_a_reward_fn_scores_each_turn_on_its_last_token():
    """`rollout.reward` (here a rule: the turn's length, ten times its index added) scores each
    turn from what came before it; the env's step rewards are not used."""
    seen: list[Sample] = []

    async def per_turn(view: Sample) -> float:
        seen.append(view)
        return float(len(view.response)) + 10 * view.metadata["turn"]

    _, s = _per_turn_episode(per_turn)
    ends = _model_ends(s)
    assert s.metadata[POSITIONS_KEY] == [[e, r] for e, r in zip(ends, [1.0, 12.0, 23.0], strict=True)]
    assert s.reward == 36.0 and s.metadata["turn_rewards"] == [1.0, 12.0, 23.0]
    by_turn = {v.metadata["turn"]: v for v in seen}
    assert [by_turn[t].response for t in range(3)] == ["a", "bb", "ccc"]
    assert by_turn[2].prompt == "p:a[obs 1]bb[obs 2]" and by_turn[0].prompt == "p:"
    assert all(v.label == "ref" for v in seen)
    from verst.trainer.train.batch import build_train_batch

    row = build_train_batch([[s]]).turn_rewards[0]
    assert {i: row[i].item() for i in row.nonzero().flatten().tolist()} == dict(
        zip(ends, [1.0, 12.0, 23.0], strict=True)
    )


@pytest.fixture(scope="module")
def judge_model(tmp_path_factory):
    torch.set_num_threads(1)
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("turn_judge") / "m", seed=3))


def test_a_real_judge_scores_each_turn(judge_model):
    """A tiny embedded judge (yes/no log-probs) scores the three turns; each turn-end token gets
    the judge's score of that turn's view, the sample's reward is their sum."""
    config = JudgeConfig(
        parser="yes_no_logprob", yes="y", no="n", template="{prompt}|{response}|", cache=False
    )
    engine = EmbeddedEngine.from_pretrained(judge_model)
    try:
        judge = JudgeReward(EngineJudge(engine), config)
        _, s = _per_turn_episode(judge)
        expect = [
            asyncio.run(JudgeReward(EngineJudge(engine), config)(Sample(prompt=p, response=r, label="ref")))
            for p, r in [("p:", "a"), ("p:a[obs 1]", "bb"), ("p:a[obs 1]bb[obs 2]", "ccc")]
        ]
    finally:
        asyncio.run(engine.close())
    got = [r for _, r in s.metadata[POSITIONS_KEY]]
    assert [i for i, _ in s.metadata[POSITIONS_KEY]] == _model_ends(s)
    assert got == pytest.approx(expect, abs=1e-6) and len(set(got)) == 3
    assert all(0 < r < 1 for r in got) and s.reward == pytest.approx(sum(expect), abs=1e-6)
    assert judge.calls == 3


def test_a_failing_turn_reward_is_a_reward_error():
    """The reward fails on the first episode's second turn: that episode is FAILED and counted
    (`rollout/reward_errors`), the rollout goes on with the next episode."""

    async def fails_on_p(view: Sample) -> float:
        if view.prompt.startswith("p:") and view.metadata["turn"] == 1:
            raise RuntimeError("judge down")
        return 1.0

    ctx = context(
        ScriptEngine(_replies),
        prompts=["p:", "q:"],
        reward_fn=fails_on_p,
        env={"type": "tools", "reward": "per_turn_reward_fn"},
    )
    strategy = InferenceRollout(ctx)
    strategy.generate_fn.factory = ThreeTurns
    result = asyncio.run(strategy(RolloutRequest(0)))
    assert result.metrics["rollout/reward_errors"] == 1
    kept = result.groups[0][0]
    assert kept.prompt == "q:" and kept.reward == 3.0 and kept.status is Status.COMPLETED
