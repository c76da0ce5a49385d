"""`rollout.env.reward = "per_turn"` through a real episode: each step's reward sits on the last
token of the model turn it follows, in the sample and in the train batch."""

from __future__ import annotations

import asyncio

from agentic_testkit import ScriptEngine, context

from verst.rollout.agentic import StepResult
from verst.rollout.agentic.turn_rewards import POSITIONS_KEY
from verst.rollout.protocols import RolloutRequest
from verst.rollout.strategies.inference import InferenceRollout


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
