"""Shared helpers of the MoE trainer tests: groups of samples with a recorded routing, and a
`TrainSide` on a tiny MoE with `[train.moe]` set."""

from __future__ import annotations

from typing import Any

import torch

from verst.rollout.moe import RoutedExperts
from verst.rollout.sample import Sample, Status
from verst.trainer.algorithms import AlgorithmConfig
from verst.trainer.config import TrainConfig
from verst.trainer.train.moe import MoeSection
from verst.trainer.train.side import TrainSide


def routed_groups(n_groups: int = 3, size: int = 4, layers: int = 2, k: int = 2) -> list[list[Sample]]:
    """`n_groups` groups of `size`; every sample carries a (random, valid) recorded routing."""
    gen = torch.Generator().manual_seed(3)
    groups = []
    for g in range(n_groups):
        prompt = torch.randint(4, 60, (2 + g,), generator=gen).tolist()
        group = []
        for j in range(size):
            r = 1 + (3 * g + j) % 5
            tokens = prompt + torch.randint(4, 60, (r,), generator=gen).tolist()
            rows = (len(tokens) - 1) * layers
            ids = torch.stack([torch.randperm(8, generator=gen)[:k] for _ in range(rows)])
            group.append(
                Sample(
                    prompt=str(g),
                    tokens=tokens,
                    response_length=r,
                    reward=float((g * j) % 3),
                    status=Status.COMPLETED,
                    rollout_logprobs=[-2.0] * r,
                    routed_experts=RoutedExperts.from_tensor(ids.reshape(len(tokens) - 1, layers, k)),
                    group_index=g,
                    sample_index=size * g + j,
                )
            )
        groups.append(group)
    return groups


def moe_side(
    model: str,
    *,
    total_steps: int,
    env: dict[str, str] | None = None,
    moe: dict[str, Any] | None = None,
    **train: Any,
) -> TrainSide:
    """A `TrainSide` on `model` (micro-batches of 2, one thread) with `[train.moe]` = `moe`."""
    cfg = TrainConfig(
        model_path=model,
        micro_batch_size=train.pop("micro_batch_size", 2),
        num_threads=1,
        moe=MoeSection(**(moe or {})),
        **train,
    )
    return TrainSide(
        cfg,
        AlgorithmConfig(),
        model_path=model,
        total_steps=total_steps,
        max_response_len=5,
        temperature=1.0,
        env=env or {},
    )
