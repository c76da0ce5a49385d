"""Step metrics mean what the docs say with several updates per rollout.

`train/loss`, `train/pg_loss` and `train/kl_loss` are the mean of the updates' losses (they were
summed: two updates of -0.2766 reported -0.5533); `train/logprob_mismatch` is |old − rollout|,
the trainer's log-probs before the step's updates against the engine's (it was measured with the
weights of each mini-batch's forward, after earlier updates had moved them).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_train_fsdp import _groups

from verst.trainer.algorithms import AlgorithmConfig
from verst.trainer.config import TrainConfig
from verst.trainer.train.batch import build_train_batch
from verst.trainer.train.side import TrainSide


def _twice(groups):
    """The groups followed by a copy of them (new group indices): two equal halves of a batch."""
    n = len(groups)
    return groups + [[dataclasses.replace(s, group_index=s.group_index + n) for s in g] for g in groups]


def _side(model: str, algo: dict, **train) -> TrainSide:
    torch.set_num_threads(1)
    cfg = TrainConfig(model_path=model, micro_batch_size=4, num_threads=1, **train)
    return TrainSide(
        cfg,
        AlgorithmConfig(**algo),
        model_path=model,
        total_steps=1,
        max_response_len=5,
        temperature=1.0,
        env={},
    )


def test_losses_are_means_over_updates_not_sums(tiny_checkpoint, tmp_path):
    """Two identical halves, weights that barely move: each update's loss is the full batch's."""
    from verst.rollout.toy import make_tiny_checkpoint

    other = make_tiny_checkpoint(tmp_path / "ref", seed=1)  # a reference unlike the policy: KL > 0
    algo = {"kl_coef": 0.1, "use_kl_loss": True, "loss_agg": "token_mean"}  # token_mean: pg_loss != 0
    one = _side(str(tiny_checkpoint), algo, lr=1e-30, ref_model_path=str(other))
    vocab = one.bundle.hf_model.config.vocab_size
    groups = _groups(vocab)
    ref = one.train_step(build_train_batch(groups))
    two = _side(str(tiny_checkpoint), algo, lr=1e-30, num_updates_per_rollout=2, ref_model_path=str(other))
    got = two.train_step(build_train_batch(_twice(groups)))
    for key in ("train/loss", "train/pg_loss", "train/kl_loss"):
        assert abs(ref[key]) > 1e-6, key
        assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-7), f"{key}: {got[key]} vs {ref[key]}"
    assert got["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=1e-4)


@pytest.mark.parametrize("as_old", [False, True], ids=["old_recomputed", "rollout_as_old"])
def test_logprob_mismatch_is_old_minus_rollout_with_several_updates(tiny_checkpoint, as_old):
    side = _side(
        str(tiny_checkpoint), {"use_rollout_logprobs_as_old": as_old}, lr=0.05, num_updates_per_rollout=2
    )
    groups = _groups(side.bundle.hf_model.config.vocab_size)
    batch = build_train_batch(_twice(groups))  # two equal halves
    old = side.compute_old_logprobs(batch)  # [B, R] before any update
    diff = (old - batch.rollout_logprobs).abs() * batch.loss_mask
    want = float(diff.sum() / batch.loss_mask.sum())
    got = side.train_step(batch)
    after = side.compute_old_logprobs(batch)
    assert float((after - old).abs().max()) > 1e-2  # the updates really moved the weights
    assert got["train/logprob_mismatch"] == pytest.approx(want, rel=1e-5)
    assert got["train/logprob_mismatch_max"] == pytest.approx(float(diff.max()), rel=1e-5)
