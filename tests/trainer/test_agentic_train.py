"""Multi-turn trajectories from the real embedded engine, scored by the real trainer.

- the trainer's log-probs of the model tokens of a real multi-turn trajectory equal the
  engine's within 1e-4 (the trainer scores exactly the tokens the engine saw and produced);
- TIS weights and the loss only involve trainable tokens: what sits at injected positions
  (their placeholder rollout log-probs) cannot change the loss;
- `build_train_batch` never drops a group silently: unequal sizes are counted per reason.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from verst.rollout.agentic import StepResult
from verst.rollout.config import RolloutConfig
from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.lifecycle import ListSink
from verst.rollout.protocols import RolloutContext, RolloutRequest
from verst.rollout.sample import Sample, Status
from verst.rollout.strategies.inference import InferenceRollout
from verst.trainer.algorithms import AlgorithmConfig
from verst.trainer.algorithms.aggregation import LossNorm
from verst.trainer.algorithms.algorithm import build_algorithm
from verst.trainer.config import TrainConfig
from verst.trainer.train.batch import build_train_batch
from verst.trainer.train.side import TrainSide


class CountdownEnv:
    """Replies '#<n>=' for three turns (an observation the model did not write), then ends."""

    def __init__(self) -> None:
        self.n = 0

    async def reset(self, sample):
        return None

    async def step(self, turn) -> StepResult:
        self.n += 1
        if self.n >= 3:
            return StepResult(done=True, reward=float(len(turn.token_ids) % 2))
        return StepResult(observation=f"\n#{self.n}=", reward=0.0)

    async def close(self):
        pass


class ListSource:
    def __init__(self, prompts, n):
        self.prompts, self.n, self.back = prompts, n, []

    def get_samples(self, k):
        out, self.prompts = self.prompts[:k], self.prompts[k:]
        return [[Sample(prompt=p).clone() for _ in range(self.n)] for p in out]

    def add_samples(self, groups):
        self.back += groups

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


@pytest.fixture(scope="module")
def trajectories(tiny_checkpoint):
    torch.set_num_threads(1)
    engine = EmbeddedEngine.from_pretrained(tiny_checkpoint)
    config = RolloutConfig(
        batch_size=2,
        n_samples_per_prompt=3,
        max_response_len=6,
        temperature=1.0,
        seed=3,
        env={"max_turns": 4},
    )
    ctx = RolloutContext(
        config=config,
        data_source=ListSource(["12+3=", "45+67="], 3),
        engine=engine,
        tokenizer=engine.tokenizer,
        sink=ListSink(),
    )
    strategy = InferenceRollout(ctx)
    strategy.generate_fn.factory = CountdownEnv
    try:
        yield asyncio.run(strategy(RolloutRequest(0))).groups
    finally:
        asyncio.run(engine.close())


def test_trainer_logprobs_match_engine_on_model_tokens_of_multi_turn_trajectories(
    tiny_checkpoint, trajectories
):
    samples = [s for g in trajectories for s in g]
    assert all(s.metadata["termination"] == "env_done" for s in samples)
    assert all(sum(g["source"] == "env" for g in s.metadata["segments"]) == 2 for s in samples)
    for s in samples:
        s.validate()
    batch = build_train_batch(trajectories)
    assert batch.has_rollout_logprobs and batch.num_samples == 6
    assert 0 < float(batch.loss_mask.sum()) < sum(batch.response_lengths)  # observations are masked
    side = TrainSide(
        TrainConfig(model_path=str(tiny_checkpoint), micro_batch_size=4),
        AlgorithmConfig(),
        model_path=str(tiny_checkpoint),
        total_steps=1,
        max_response_len=64,
        temperature=1.0,
        env={},
    )
    ours = side.compute_old_logprobs(batch)  # [B, R]
    diff = (ours - batch.rollout_logprobs).abs() * batch.loss_mask
    assert float(diff.max()) < 1e-4, f"max |trainer - engine| on model tokens = {float(diff.max())}"
    # on injected tokens the engine gave no log-prob: the placeholder is never compared or trained
    injected = (1 - batch.loss_mask) * (
        torch.arange(batch.loss_mask.shape[1]) < torch.tensor(batch.response_lengths)[:, None]
    )
    assert float((batch.rollout_logprobs * injected).abs().sum()) == 0.0
    metrics = side.train_step(batch)
    assert metrics["train/logprob_mismatch_max"] < 1e-4


def test_tis_and_the_loss_ignore_injected_positions():
    torch.manual_seed(0)
    lp = torch.randn(2, 6, dtype=torch.float64).clamp(max=-0.01)
    old = lp + 0.05 * torch.randn(2, 6, dtype=torch.float64)
    roll = old + 0.2 * torch.randn(2, 6, dtype=torch.float64)
    adv = torch.randn(2, 6, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 1, 0]], dtype=torch.float64)
    norm = LossNorm.from_masks([mask], 6)
    algo = build_algorithm(AlgorithmConfig(tis=True, tis_cap=2.0))
    base = algo.loss(lp, old, adv, mask, rollout_logprobs=roll, norm=norm)
    scrambled = roll.clone()
    scrambled[mask == 0] = torch.tensor(
        [-40.0, 0.0, -1e-3, -7.0, 3.0], dtype=torch.float64
    )  # anything at injected positions
    other = algo.loss(lp, old, adv, mask, rollout_logprobs=scrambled, norm=norm)
    assert other.loss.item() == pytest.approx(base.loss.item(), rel=1e-12)
    for key in ("tis_weight_mean", "tis_clip_frac", "logprob_mismatch"):
        assert float(other.metrics[key]) == pytest.approx(float(base.metrics[key]), rel=1e-12)


def _group(gi: int, n: int) -> list[Sample]:
    return [
        Sample(
            prompt=f"p{gi}",
            tokens=[1, 2, 3],
            response_length=1,
            reward=float(j),
            status=Status.COMPLETED,
            group_index=gi,
        )
        for j in range(n)
    ]


def test_unequal_groups_are_counted_and_logged_never_silently_dropped(caplog):
    groups = [_group(0, 4), _group(1, 4), _group(2, 3), _group(3, 4), []]
    groups[3][0].status = Status.FAILED
    with caplog.at_level(logging.WARNING, logger="verst.trainer.train.batch"):
        batch = build_train_batch(groups)
    assert batch.group_size == 4 and batch.metrics["train/groups"] == 2
    assert batch.metrics["train/dropped_groups"] == 3
    assert batch.metrics["train/dropped/unequal_group_size"] == 1
    assert batch.metrics["train/dropped/failed_or_unscored"] == 1
    assert batch.metrics["train/dropped/empty"] == 1
    assert "differs from the common size 4" in caplog.text and "group 2 with 3 samples" in caplog.text
