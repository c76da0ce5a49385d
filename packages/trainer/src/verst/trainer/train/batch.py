"""A rollout's groups of samples → one train batch, and its split into micro-batches.

Only groups whose every sample finished and was scored are trained on: a group with a FAILED
sample, an unscored sample, or a different size than the others is dropped, counted per reason
(`train/dropped_groups`, `train/dropped/<reason>`: `failed_or_unscored`, `empty`,
`unequal_group_size`) and logged with the reason — never silently mixed in (GRPO-family
advantages need whole groups of one size). A generate function cannot produce unequal groups
on the default path (it must return one sample per input); a custom strategy can.
Tensors are response-aligned and right-padded to the longest response: `[num_samples, R]`.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from verst.rollout.sample import Sample, Status
from verst.trainer.opd.train import OpdBatch, collate_opd

logger = logging.getLogger(__name__)


@dataclass
class TrainBatch:
    """Everything a train step needs about a rollout's samples."""

    tokens: list[list[int]]
    """Prompt + response ids per sample."""
    response_lengths: list[int]
    """Response length per sample."""
    loss_mask: torch.Tensor  # [B, R]
    """1.0 for trained response tokens, 0.0 for masked tokens and padding."""
    rollout_logprobs: torch.Tensor  # [B, R]
    """The engine's log-prob of each sampled token (0 where unknown)."""
    has_rollout_logprobs: bool
    """True when every sample carried rollout log-probs."""
    rewards: torch.Tensor  # [G, n]
    """Scalar reward per sample, grouped."""
    group_size: int
    """n, samples per group."""
    weight_versions: list[list[int]]
    """Engine weight versions each sample was generated with."""
    prompts: list[str]
    """The prompt of each kept group, in batch order."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Batch statistics (dropped groups, lengths, rewards)."""
    opd: OpdBatch | None = None
    """Teacher data for on-policy distillation (None when no sample was distilled)."""
    sample_keys: list[tuple[int | None, int | None]] = field(default_factory=list)
    """(group_index, sample_index) of each row: which sample a row is."""
    record_rows: list[int] = field(default_factory=list)
    """Rows whose per-token values (advantages, the trainer's log-probs) the train step keeps for
    the run's trajectory recording (`TrainSide.step_detail`); empty = none."""
    routed_experts: list[Any] = field(default_factory=list)
    """Per sample, the engine's recorded MoE routing (`RoutedExperts`, or None), for
    `train.moe.routing_replay = 'rollout'`; empty when no sample carried any."""
    images: list[list[dict]] | None = None
    """Per sample its `Sample.images` recipes (vision-language models; None when no sample has one)."""
    turn_rewards: torch.Tensor | None = None  # [B, R]
    """Per-turn rewards at each turn's last token (`rollout.env.reward = "per_turn"`); None = none."""

    @property
    def num_samples(self) -> int:
        return len(self.tokens)

    @property
    def max_response_len(self) -> int:
        return self.loss_mask.shape[1]


def _usable(group: list[Sample], reward_key: str | None) -> bool:
    """Every sample finished (not FAILED), has tokens and a (scalar-readable) reward."""
    for s in group:
        if s.status == Status.FAILED or s.reward is None or not s.tokens:
            return False
        try:
            s.scalar_reward(reward_key)
        except Exception:
            return False
    return True


def _keep_groups(
    groups: Sequence[list[Sample]], reward_key: str | None
) -> tuple[list[list[Sample]], Counter[str]]:
    """The usable groups of the common size, in `group_index` order, and why the others were dropped."""
    reasons: Counter[str] = Counter()
    kept = []
    for g in groups:
        if not g:
            reasons["empty"] += 1
        elif not _usable(g, reward_key):
            reasons["failed_or_unscored"] += 1
        else:
            kept.append(g)
    kept.sort(key=lambda g: (g[0].group_index is None, g[0].group_index or 0))
    sizes = Counter(len(g) for g in kept)
    if len(sizes) > 1:
        common = max(sizes, key=lambda n: (sizes[n], n))
        odd = [g for g in kept if len(g) != common]
        reasons["unequal_group_size"] += len(odd)
        logger.warning(
            "dropping %d of %d groups whose size differs from the common size %d (sizes %s): GRPO-family "
            "advantages need groups of one size; a strategy or generate function returned groups of "
            "unequal size (first dropped: group %s with %d samples)",
            len(odd),
            len(kept),
            common,
            dict(sorted(sizes.items())),
            odd[0][0].group_index,
            len(odd[0]),
        )
        kept = [g for g in kept if len(g) == common]
    if not kept:
        raise ValueError(
            f"no trainable groups in this rollout ({len(groups)} groups, all failed, unscored or empty); "
            "check the engine and reward function logs"
        )
    return kept, reasons


def _response_tensors(samples: list[Sample], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss mask and rollout log-probs `[B, width]` (zero past each response and where unknown),
    each from one padded list (one tensor build, not one per row). Lengths are validated."""
    mask = [[*s.effective_loss_mask(), *[0] * (width - s.response_length)] for s in samples]
    old = [
        [*s.rollout_logprobs, *[0.0] * (width - s.response_length)]
        if s.rollout_logprobs is not None
        else [0.0] * width
        for s in samples
    ]
    return torch.tensor(mask, dtype=torch.float32), torch.tensor(old, dtype=torch.float32)


def _batch_metrics(
    kept: list[list[Sample]],
    samples: list[Sample],
    rewards: torch.Tensor,
    dropped: int,
    reasons: Counter[str],
) -> dict[str, float]:
    """Dropped groups (by reason), response lengths, rewards, truncation and weight versions."""
    lengths = [s.response_length for s in samples]
    metrics = {
        "train/groups": float(len(kept)),
        "train/dropped_groups": float(dropped),
        **{f"train/dropped/{reason}": float(n) for reason, n in sorted(reasons.items())},
        "train/response_len_mean": float(sum(lengths) / len(lengths)),
        "train/response_len_max": float(max(lengths)),
        "train/reward_mean": float(rewards.mean()),
        "train/truncated_frac": float(sum(s.status == Status.TRUNCATED for s in samples) / len(samples)),
    }
    versions = [v for s in samples for v in s.weight_versions]
    if versions:
        metrics["train/sample_weight_version_min"] = float(min(versions))
        metrics["train/sample_weight_version_max"] = float(max(versions))
    return metrics


def build_train_batch(groups: Sequence[list[Sample]], *, reward_key: str | None = None) -> TrainBatch:
    """Collate usable groups (see module doc) into a `TrainBatch`, in `group_index` order.

    Strategies return groups in completion order; sorting by the index they were submitted
    with makes the batch (and so the float summation order) independent of engine timing.
    """
    kept, reasons = _keep_groups(groups, reward_key)
    samples = [s for g in kept for s in g]
    for s in samples:
        s.validate()
    width = max(1, max(s.response_length for s in samples))
    mask, old = _response_tensors(samples, width)
    rewards = torch.tensor([[s.scalar_reward(reward_key) for s in g] for g in kept], dtype=torch.float32)
    return TrainBatch(
        tokens=[list(s.tokens) for s in samples],
        response_lengths=[s.response_length for s in samples],
        loss_mask=mask,
        rollout_logprobs=old,
        has_rollout_logprobs=all(s.rollout_logprobs is not None for s in samples),
        rewards=rewards,
        group_size=len(kept[0]),
        weight_versions=[list(s.weight_versions) for s in samples],
        prompts=[str(g[0].prompt) for g in kept],
        metrics=_batch_metrics(kept, samples, rewards, len(groups) - len(kept), reasons),
        opd=collate_opd(samples, width),
        sample_keys=[(s.group_index, s.sample_index) for s in samples],
        routed_experts=[s.routed_experts for s in samples]
        if any(s.routed_experts is not None for s in samples)
        else [],
        images=[list(s.images or []) for s in samples] if any(s.images for s in samples) else None,
        turn_rewards=_turn_rewards(samples, width),
    )


def _turn_rewards(samples: list[Sample], width: int) -> torch.Tensor | None:
    """`[B, width]` per-turn rewards when any sample carries them (agentic `per_turn`), else None."""
    from verst.rollout.agentic.turn_rewards import POSITIONS_KEY, turn_reward_row

    if not any(POSITIONS_KEY in s.metadata for s in samples):
        return None
    return torch.tensor([turn_reward_row(s, width) for s in samples], dtype=torch.float32)


def split_even(indices: Sequence[int], parts: int) -> list[list[int]]:
    """Split into `parts` contiguous chunks whose sizes differ by at most one (some may be empty)."""
    n = len(indices)
    out, start = [], 0
    for p in range(parts):
        size = n // parts + (1 if p < n % parts else 0)
        out.append(list(indices[start : start + size]))
        start += size
    return out


def micro_batches(
    rows: Sequence[int],
    micro_batch_size: int,
    *,
    rank: int,
    world_size: int,
    keys: Sequence[Hashable] | None = None,
) -> list[list[int]]:
    """This rank's micro-batches of `rows`.

    Rows are dealt to ranks in contiguous even chunks; every rank gets the SAME number of
    micro-batches (FSDP collectives must line up), so some may be empty on some ranks.
    `keys[row]` (optional): rows with equal keys (samples of one prompt) are kept in one
    micro-batch where the count and `micro_batch_size` allow it (`split_at_groups`), so the
    shared-prompt layout computes each prompt once.
    """
    per_rank = split_even(rows, world_size)
    count = max(1, max(-(-len(chunk) // micro_batch_size) for chunk in per_rank))
    if keys is None:
        return split_even(per_rank[rank], count)
    return split_at_groups(per_rank[rank], count, micro_batch_size, keys)


def split_at_groups(
    rows: Sequence[int], parts: int, capacity: int, keys: Sequence[Hashable]
) -> list[list[int]]:
    """Split `rows` into `parts` contiguous chunks of at most `capacity` rows, cutting between
    rows of different `keys` where it can.

    Each cut starts where `split_even` would put it and moves to the nearest change of key that
    keeps every chunk within `capacity` (and, when there are at least `parts` rows, non-empty);
    with no such change in reach it stays where it was. Needs `len(rows) <= parts * capacity`.
    """
    n = len(rows)
    if n > parts * capacity:
        raise ValueError(f"{n} rows do not fit {parts} chunks of {capacity}")
    changes = [i for i in range(1, n) if keys[rows[i]] != keys[rows[i - 1]]]
    bounds = [0]
    for k in range(1, parts):
        left = parts - k  # chunks after this cut
        lo = max(bounds[-1] + (1 if n >= parts else 0), n - left * capacity)
        hi = min(bounds[-1] + capacity, n - (left if n >= parts else 0))
        even = bounds[-1] + (n - bounds[-1]) / (left + 1)  # split_even of what is left
        options = [c for c in changes if lo <= c <= hi]
        if options:
            bounds.append(min(options, key=lambda c: (abs(c - even), c)))
        else:
            bounds.append(min(max(math.ceil(even), lo), hi))
    bounds.append(n)
    return [list(rows[a:b]) for a, b in itertools.pairwise(bounds)]
