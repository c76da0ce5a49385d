"""Rollout groups → train batch; micro-batching that matches the full batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from verst.rollout.sample import Sample, Status
from verst.rollout.toy import toy_groups
from verst.trainer.algorithms import AlgorithmConfig
from verst.trainer.config import TrainConfig
from verst.trainer.train.batch import build_train_batch, micro_batches, split_even
from verst.trainer.train.side import TrainSide


def _sample(
    g: int, j: int, *, reward: float | None = 1.0, status: Status = Status.COMPLETED, r: int = 3
) -> Sample:
    return Sample(
        prompt=f"p{g}",
        tokens=[10 + g, 11, 12, *[20 + j + k for k in range(r)]],
        response_length=r,
        reward=reward,
        status=status,
        rollout_logprobs=[-1.0 - k for k in range(r)],
        loss_mask=[1] * (r - 1) + [0] if r else None,
        group_index=g,
        sample_index=2 * g + j,
    )


def test_failed_and_unscored_groups_are_dropped_and_counted():
    groups = [
        [_sample(0, 0), _sample(0, 1, reward=0.0)],
        [_sample(1, 0, status=Status.FAILED, reward=None), _sample(1, 1)],
        [_sample(2, 0, reward=None), _sample(2, 1)],
        [_sample(3, 0, r=1), _sample(3, 1, r=4, reward=0.5)],
    ]
    batch = build_train_batch(groups)
    assert batch.metrics["train/dropped_groups"] == 2.0
    assert batch.rewards.tolist() == [[1.0, 0.0], [1.0, 0.5]]
    assert batch.num_samples == 4 and batch.group_size == 2
    assert batch.loss_mask.shape == (4, 4)
    assert batch.loss_mask[2].tolist() == [0.0, 0.0, 0.0, 0.0]  # r=1: its only token is masked out
    assert batch.loss_mask[3].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert batch.rollout_logprobs[3].tolist() == [-1.0, -2.0, -3.0, -4.0]


@given(
    st.lists(
        st.tuples(
            st.integers(0, 5),  # response length
            st.booleans(),  # has a loss mask
            st.booleans(),  # has rollout log-probs
            st.integers(0, 2**31),  # values
        ),
        min_size=1,
        max_size=6,
    )
)
def test_loss_mask_and_rollout_logprobs_equal_a_row_by_row_build(rows):
    """The batch's `[B, width]` mask and log-probs hold, row by row, the sample's values (float32)
    then zeros; all-zero log-probs where a sample has none."""
    samples = []
    for i, (r, has_mask, has_lp, seed) in enumerate(rows):
        gen = torch.Generator().manual_seed(seed)
        mask = torch.randint(0, 2, (r,), generator=gen).tolist() if has_mask else None
        lp = (-torch.rand(r, generator=gen, dtype=torch.float64) * 30).tolist() if has_lp else None
        samples.append(
            Sample(prompt="p", tokens=[1, 2, *range(3, 3 + r)], response_length=r, reward=1.0,
                   status=Status.COMPLETED, loss_mask=mask, rollout_logprobs=lp, group_index=i, sample_index=i)
        )  # fmt: skip
    batch = build_train_batch([[s] for s in samples])
    width = max(1, max(r for r, *_ in rows))
    want_mask, want_old = torch.zeros((len(rows), width)), torch.zeros((len(rows), width))
    for i, s in enumerate(samples):
        want_mask[i, : s.response_length] = torch.tensor(s.effective_loss_mask(), dtype=torch.float32)
        if s.rollout_logprobs is not None:
            want_old[i, : s.response_length] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    assert batch.loss_mask.dtype == batch.rollout_logprobs.dtype == torch.float32
    assert torch.equal(batch.loss_mask, want_mask) and torch.equal(batch.rollout_logprobs, want_old)
    assert batch.has_rollout_logprobs == all(has_lp for *_, has_lp, _ in rows)


def test_dict_rewards_use_the_reward_key():
    groups = [[_sample(0, 0), _sample(0, 1)]]
    groups[0][0].reward = {"acc": 1.0, "fmt": 0.2}
    groups[0][1].reward = {"acc": 0.0, "fmt": 0.4}
    assert build_train_batch(groups, reward_key="fmt").rewards.tolist() == [
        [pytest.approx(0.2), pytest.approx(0.4)]
    ]


def test_no_trainable_group_is_a_clear_error():
    with pytest.raises(ValueError, match="no trainable groups"):
        build_train_batch([[_sample(0, 0, status=Status.FAILED)]])


@given(n=st.integers(0, 40), parts=st.integers(1, 6))
def test_split_even_partitions(n, parts):
    chunks = split_even(list(range(n)), parts)
    assert len(chunks) == parts
    assert [i for c in chunks for i in c] == list(range(n))
    assert max(map(len, chunks)) - min(map(len, chunks)) <= 1


@given(n=st.integers(1, 40), mbs=st.integers(1, 9), world=st.integers(1, 4))
def test_micro_batches_cover_rows_once_with_equal_counts_per_rank(n, mbs, world):
    per_rank = [micro_batches(list(range(n)), mbs, rank=r, world_size=world) for r in range(world)]
    assert len({len(m) for m in per_rank}) == 1  # FSDP collectives line up
    rows = sorted(i for m in per_rank for mb in m for i in mb)
    assert rows == list(range(n))
    assert all(len(mb) <= mbs for m in per_rank for mb in m)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_gradient_accumulation_equals_full_batch(tiny_checkpoint, loss_agg):
    torch.set_num_threads(1)
    weights = []
    for mbs in (1, 5, 12):
        # eps=1 makes the first AdamW step ~ lr * g / (|g| + 1): linear in small gradients, so
        # weights compare the accumulated gradients (eps=1e-8 would amplify float noise of ~0 grads)
        cfg = TrainConfig(
            model_path=str(tiny_checkpoint), micro_batch_size=mbs, lr=1.0, eps=1.0, max_grad_norm=None
        )
        side = TrainSide(
            cfg,
            AlgorithmConfig(loss_agg=loss_agg),
            model_path=str(tiny_checkpoint),
            total_steps=1,
            max_response_len=5,
            temperature=1.0,
            env={},
        )
        batch = build_train_batch(
            toy_groups(side.bundle.hf_model.config.vocab_size, seed=1, reward=lambda g, j: float((g + j) % 3))
        )
        metrics = side.train_step(batch)
        weights.append((metrics["train/grad_norm"], side.state_dict_for_sync()))
    (n0, w0) = weights[0]
    for n, w in weights[1:]:
        assert n == pytest.approx(n0, rel=1e-4)
        for k in w0:
            torch.testing.assert_close(w[k], w0[k], rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
