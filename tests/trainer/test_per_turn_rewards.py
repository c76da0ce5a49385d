"""Per-turn rewards: an agentic trajectory's step rewards land on each model turn's last token
in the train batch, GAE and grpo_per_turn credit each turn with what follows it, and the other
estimators refuse them with one line (at config time and at step time)."""

from __future__ import annotations

import pytest
import torch

from verst.rollout.agentic.turn_rewards import POSITIONS_KEY, turn_reward_positions
from verst.rollout.sample import Sample, Status
from verst.trainer.algorithms import AlgorithmConfig
from verst.trainer.algorithms.algorithm import Algorithm, build_algorithm
from verst.trainer.train.batch import build_train_batch


def episode(rewards: list[float | None], turn_tokens=(2, 3, 2), obs_tokens=1) -> Sample:
    """A trajectory: model turns of `turn_tokens`, an env observation after each but the last."""
    segs, tokens, start = [], [5, 6], 0
    for t, n in enumerate(turn_tokens):
        segs.append(
            {
                "source": "model",
                "start": start,
                "length": n,
                "turn": t,
                "weight_version": 0,
                "trainable": True,
            }
        )
        start += n
        if t < len(turn_tokens) - 1:
            segs.append(
                {
                    "source": "env",
                    "start": start,
                    "length": obs_tokens,
                    "turn": t,
                    "weight_version": None,
                    "trainable": False,
                }
            )
            start += obs_tokens
    mask = [1 if s["source"] == "model" else 0 for s in segs for _ in range(s["length"])]
    s = Sample(
        prompt="p",
        tokens=tokens + [7] * start,
        response_length=start,
        loss_mask=mask,
        rollout_logprobs=[-1.0] * start,
        reward=float(sum(r or 0 for r in rewards)),
        status=Status.COMPLETED,
        metadata={"segments": segs, "turn_rewards": rewards},
        weight_versions=[0] * len(turn_tokens),
    )
    s.metadata[POSITIONS_KEY] = turn_reward_positions(s)
    return s


def test_turn_rewards_reach_each_turns_last_token():
    a, b = episode([0.5, None, 2.0]), episode([1.0, 1.0, 0.0])
    a.group_index = b.group_index = 0
    b.sample_index = 1
    assert a.metadata[POSITIONS_KEY] == [[1, 0.5], [8, 2.0]]  # turn 1 had no reward
    batch = build_train_batch([[a, b]])
    expect = torch.zeros(2, 9)
    expect[0, 1], expect[0, 8] = 0.5, 2.0
    expect[1, 1], expect[1, 5] = 1.0, 1.0
    assert torch.equal(batch.turn_rewards, expect)
    # a single-turn batch carries none
    assert (
        build_train_batch(
            [
                [
                    Sample(
                        prompt="p",
                        tokens=[1, 2],
                        response_length=1,
                        reward=1.0,
                        status=Status.COMPLETED,
                        rollout_logprobs=[-1.0],
                    )
                ]
            ]
        ).turn_rewards
        is None
    )


def _algo(advantage) -> Algorithm:
    critic = {"critic": {"lr": 1e-5}} if advantage["type"] == "gae" else {}
    return build_algorithm(AlgorithmConfig(advantage=advantage, **critic))


def test_gae_credits_each_turn_with_what_follows():
    a = episode([0.5, 0.25, 2.0])
    batch = build_train_batch([[a]])
    algo = _algo({"type": "gae", "gamma": 1.0, "lam": 1.0, "whiten": False})
    adv, _ = algo.compute_advantages_and_returns(
        batch.rewards,
        batch.loss_mask,
        values=torch.zeros_like(batch.loss_mask),
        turn_rewards=batch.turn_rewards,
    )
    # turn 0 tokens 0-1, turn 1 tokens 3-5, turn 2 tokens 7-8 (values 0: advantage = return-to-go)
    assert adv[0].tolist() == pytest.approx([2.75, 2.75, 0, 2.25, 2.25, 2.25, 0, 2.0, 2.0])


def test_grpo_per_turn_first_turn_is_grpo_later_turns_their_return_to_go():
    a, b = episode([1.0, 0.0, 1.0]), episode([0.0, 0.0, 0.0])
    b.sample_index = 1
    batch = build_train_batch([[a, b]])
    per_turn = _algo({"type": "grpo_per_turn", "normalize_std": False}).compute_advantages_and_returns(
        batch.rewards, batch.loss_mask, turn_rewards=batch.turn_rewards
    )[0]
    grpo = _algo({"type": "grpo", "normalize_std": False}).compute_advantages(batch.rewards, batch.loss_mask)
    assert per_turn[:, 0].tolist() == pytest.approx(grpo[:, 0].tolist())  # 2 - mean(2, 0) = 1; -1
    assert per_turn[0].tolist() == pytest.approx([1, 1, 0, 0, 0, 0, 0, 0, 0])  # after turn 0: 1 - 1
    assert per_turn[1].tolist() == pytest.approx([-1, -1, 0, -1, -1, -1, 0, -1, -1])


def test_other_estimators_refuse_per_turn_rewards_in_one_line():
    batch = build_train_batch([[episode([1.0, 0.0, 1.0])]])
    with pytest.raises(ValueError, match=r"'rloo' cannot use per-turn rewards.*use gae or grpo_per_turn"):
        _algo({"type": "rloo"}).compute_advantages_and_returns(
            batch.rewards, batch.loss_mask, turn_rewards=batch.turn_rewards
        )


def test_config_refuses_per_turn_with_grpo(tmp_path):
    from verst.rollout.errors import ConfigError
    from verst.trainer.config import RunConfig, validate_run_config

    cfg = RunConfig.model_validate(
        {
            "engine": {"type": "embedded", "model_path": str(tmp_path)},
            "rollout": {"env": {"reward": "per_turn"}},
        }
    )
    with pytest.raises(ConfigError, match="per_turn rewards cannot be used by advantage 'grpo'"):
        validate_run_config(cfg, {})


def test_config_refuses_per_turn_reward_fn_with_grpo_and_with_group_rewards(tmp_path):
    from verst.rollout.errors import ConfigError
    from verst.trainer.config import RunConfig, validate_run_config

    cfg = RunConfig.model_validate(
        {
            "engine": {"type": "embedded", "model_path": str(tmp_path)},
            "rollout": {"env": {"reward": "per_turn_reward_fn"}, "reward": {"group": True}},
        }
    )
    with pytest.raises(ConfigError) as info:
        validate_run_config(cfg, {})
    text = str(info.value)
    assert "per_turn_reward_fn rewards cannot be used by advantage 'grpo'" in text
    assert "set rollout.reward.group = false" in text
