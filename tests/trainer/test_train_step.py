"""Train-step variants on the real tiny model: KL (loss and reward), several updates per
rollout, TIS, rollout log-probs as old, GSPO, entropy bonus — finite metrics, moving weights."""

from __future__ import annotations

import math

import pytest
import torch

from verst.rollout.sample import Sample, Status
from verst.trainer.algorithms import AlgorithmConfig
from verst.trainer.config import TrainConfig
from verst.trainer.train.batch import build_train_batch
from verst.trainer.train.side import TrainSide


def _groups(vocab: int) -> list[list[Sample]]:
    gen = torch.Generator().manual_seed(5)
    groups = []
    for g in range(2):
        group = []
        for j in range(4):
            p, r = 3, 2 + (g + j) % 4
            tokens = torch.randint(4, vocab, (p + r,), generator=gen).tolist()
            group.append(
                Sample(
                    prompt=str(g),
                    tokens=tokens,
                    response_length=r,
                    reward=float(j % 2 + g),
                    status=Status.COMPLETED,
                    rollout_logprobs=[-3.0 - 0.1 * k for k in range(r)],
                    group_index=g,
                    sample_index=4 * g + j,
                )
            )
        groups.append(group)
    return groups


CASES = {
    "kl_loss": ({"kl_coef": 0.1, "use_kl_loss": True}, {}),
    "kl_reward": ({"kl_coef": 0.1, "use_kl_in_reward": True, "advantage": "reinforce_pp"}, {}),
    "two_updates": ({}, {"num_updates_per_rollout": 2}),
    "tis": ({"tis": True}, {}),
    "rollout_as_old": ({"use_rollout_logprobs_as_old": True}, {}),
    "gspo": ({"policy_loss": "gspo"}, {"micro_batch_size": 3}),
    "entropy": ({"entropy_coef": 0.01}, {"packing": False}),
    "cosine_warmup": ({}, {"scheduler": "cosine", "warmup_steps": 2}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_step_variants(tiny_checkpoint, case):
    torch.set_num_threads(1)
    algo, train = CASES[case]
    cfg = TrainConfig(
        model_path=str(tiny_checkpoint), lr=1e-2, micro_batch_size=train.pop("micro_batch_size", 4), **train
    )
    side = TrainSide(
        cfg,
        AlgorithmConfig(**algo),
        model_path=str(tiny_checkpoint),
        total_steps=3,
        max_response_len=5,
        temperature=1.0,
        env={},
    )
    assert (side.ref is not None) == ("kl_coef" in algo)
    batch = build_train_batch(_groups(side.bundle.hf_model.config.vocab_size))
    before = {k: v.clone() for k, v in side.state_dict_for_sync().items()}
    m1 = side.train_step(batch)
    m2 = side.train_step(batch)
    for m in (m1, m2):
        assert all(math.isfinite(v) for v in m.values()), m
    assert side.optimizer_steps == 2 * cfg.num_updates_per_rollout
    after = side.state_dict_for_sync()
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 1e-4
    if "kl_coef" in algo:
        assert m1["train/kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at first
        assert m2["train/kl"] > 1e-7
    if case == "two_updates":
        assert m1["train/ratio_mean"] != pytest.approx(1.0, abs=1e-7)  # second mini-batch is off-policy
    if case == "tis":
        assert "train/tis_weight_mean" in m1
    if case == "cosine_warmup":
        assert m1["train/lr"] == pytest.approx(5e-3) and m2["train/lr"] == pytest.approx(1e-2)


def test_lr_schedules():
    from verst.trainer.train.optim import lr_lambda

    cos = lr_lambda(TrainConfig(scheduler="cosine", warmup_steps=2, min_lr_ratio=0.1), total_steps=6)
    assert [round(cos(s), 4) for s in range(7)] == [0.5, 1.0, 1.0, 0.8682, 0.55, 0.2318, 0.1]
    lin = lr_lambda(TrainConfig(scheduler="linear"), total_steps=4)
    assert [lin(s) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    const = lr_lambda(TrainConfig(warmup_steps=4), total_steps=10)
    assert [const(s) for s in (0, 3, 9)] == [0.25, 1.0, 1.0]
