"""`rollout.eval.datasets.<name>.reward`: an eval set scored by its own reward, not the
training one; a bad table is reported under its own key before anything runs."""

from __future__ import annotations

import pytest
from inference_testkit import make_context

from verst.rollout.config import RolloutConfig
from verst.rollout.errors import ConfigError
from verst.rollout.protocols import RolloutRequest
from verst.rollout.sample import Sample
from verst.rollout.strategies.inference import InferenceRollout
from verst.rollout.validation import validate_rollout_config


def _eval_set(n: int) -> list[Sample]:
    return [Sample(prompt=f"q{i}", label="never said") for i in range(n)]


async def test_an_eval_set_with_its_own_reward_is_scored_by_it():
    """Training reward: `length_reward` (0 or 1 by length parity). `own` is scored by
    `exact_match` against a label no answer matches (0 for all); `same` keeps the training
    reward. Both see the same prompts and greedy answers."""
    ctx = make_context(
        eval={
            "datasets": {
                "own": {"path": "unused.jsonl", "reward": {"type": "exact_match"}},
                "same": {"path": "unused.jsonl"},
            }
        }
    )
    ctx.eval_datasets = {"own": _eval_set(6), "same": _eval_set(6)}
    strategy = InferenceRollout(ctx)
    result = await strategy(RolloutRequest(0, evaluation=True))
    own = [s.reward for g in result.eval["own"] for s in g]
    same = [s.reward for g in result.eval["same"] for s in g]
    expected = [float(s.response_length % 2 == 0) for g in result.eval["same"] for s in g]
    assert own == [0.0] * 6 and same == expected and sum(same) > 0
    assert result.metrics["eval/own/reward_mean"] == 0.0
    assert result.metrics["eval/same/reward_mean"] == pytest.approx(sum(expected) / 6)
    await strategy.close()


def test_a_bad_eval_reward_is_one_error_naming_its_key(tmp_path):
    data = tmp_path / "eval.jsonl"
    data.write_text('{"prompt": "a", "label": "b"}\n')
    config = RolloutConfig(
        eval={
            "datasets": {
                "h": {"path": str(data), "reward": {"type": "no_such_rule"}},
                "j": {"path": str(data), "reward": {"type": "judge"}},
            }
        }
    )
    with pytest.raises(ConfigError) as info:
        validate_rollout_config(config, {})
    keys = {p.key for p in info.value.problems}
    assert keys == {"rollout.eval.datasets.h.reward.type", "rollout.eval.datasets.j.reward.judge"}
    assert "add [rollout.eval.datasets.j.reward.judge]" in str(info.value)
