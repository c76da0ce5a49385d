"""A decode batch's prompt KV kept once per distinct prompt: the "prefix" half of a split cache.

A GRPO group's n rows share one prompt. The flat layout (`embedded.batch`'s default) copies that
prompt's keys and values into each of the n rows, and every decode step then reads the prompt
n times per layer — and the prompt is most of the cache (64–256 prompt tokens against ≤128 new
ones at the scale benchmark). The split layout keeps each distinct prompt's KV once here
(`[groups, kv_heads, prefix width, head_dim]` per layer, left-padded, `mask` marking the real
columns) and each row's own generated tokens in the batch's growing cache (the "suffix"); a
decode step scores the group's rows' queries against the unrepeated prompt keys in one batched
matmul (`attention.TwoPartAttention`).

`GroupLayout` says where each slot sits in the `[groups, size]` grid that matmul runs on: slot s
is member `j` of group `g` at grid place `g · size + j`. When the slots are exactly the grid in
order (every group `size` rows, one after another: a fresh GRPO batch) the grid is a reshape of
the slots; otherwise queries are scattered into it (empty places are zero queries, never read
back) and results gathered out. Groups are only dropped when the batch compacts its slots, so
a finished row's slot keeps its group until then (decoded and ignored, as in the flat layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from verst.rollout.engines.embedded.kv_cache import cat_left_padded, growing_cache


@dataclass(frozen=True, slots=True)
class GroupLayout:
    """Where each of a batch's slots sits in the `[groups, size]` grid of the prefix matmul."""

    groups: int
    size: int
    """The most slots any group has (the grid's width)."""
    place: torch.Tensor | None
    """`[slots]` long: slot → `g · size + j`; None when that is the identity (the slots are the grid)."""

    @classmethod
    def of(cls, group: torch.Tensor, groups: int) -> GroupLayout:
        """The layout of slots whose groups are `group` (`[slots]` long, values in `[0, groups)`)."""
        gs = group.tolist()
        seen = [0] * groups
        member = []
        for g in gs:
            member.append(seen[g])
            seen[g] += 1
        size = max(seen)
        place = [g * size + j for g, j in zip(gs, member, strict=True)]
        if place == list(range(groups * size)):
            return cls(groups, size, None)
        return cls(groups, size, torch.tensor(place, device=group.device))

    def to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """`[slots, kv, rep, c]` → `[groups, kv, size · rep, c]` (a group's members' rows in order)."""
        _, kv, rep, c = x.shape
        if self.place is not None:
            x = x.new_zeros((self.groups * self.size, kv, rep, c)).index_copy_(0, self.place, x)
        return x.view(self.groups, self.size, kv, rep, c).transpose(1, 2).reshape(self.groups, kv, -1, c)

    def grid_rows(self, y: torch.Tensor) -> torch.Tensor:
        """`[groups, kv, size · rep, c]` → the same values as `[groups, size, kv, rep, c]` (a view)."""
        g, kv, _, c = y.shape
        return y.view(g, kv, self.size, -1, c).transpose(1, 2)

    def to_slots(self, y: torch.Tensor) -> torch.Tensor:
        """`[groups, kv, size · rep, c]` → `[slots, kv, rep, c]` (`to_grid`'s inverse)."""
        rows = self.grid_rows(y)
        flat = rows.reshape(-1, *rows.shape[2:])
        return flat if self.place is None else flat.index_select(0, self.place)

    def join(self, grid: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """`[groups, kv, size · rep, a]` and `[slots, kv, rep, b]` → `[slots, kv, rep, a + b]`: one
        copy when the slots are the grid (the concatenation reads the grid's rows in place)."""
        if self.place is not None:
            return torch.cat([self.to_slots(grid), slots], dim=-1)
        rows = self.grid_rows(grid)  # [groups, size, kv, rep, a]
        joined = torch.cat([rows, slots.view(*rows.shape[:-1], slots.shape[-1])], dim=-1)
        return joined.view(-1, *joined.shape[2:])


@dataclass(frozen=True, slots=True)
class PrefixKV:
    """Each distinct prompt's KV once, and which of them each slot of the batch attends to."""

    keys: list[torch.Tensor]
    """Per cache layer, `[groups, kv_heads, width, head_dim]` (left-padded)."""
    values: list[torch.Tensor]
    mask: torch.Tensor  # [groups, width] long
    """1 = a prompt token, 0 = left padding."""
    group: torch.Tensor  # [slots] long
    """Each slot's group."""
    layout: GroupLayout = field(init=False)
    bias: torch.Tensor = field(init=False)  # [slots, 1, 1, width]
    """Each slot's additive mask over the prefix columns (0 = attend, -inf = padding)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", GroupLayout.of(self.group, self.mask.shape[0]))
        bias = torch.zeros(self.mask.shape, dtype=self.keys[0].dtype, device=self.mask.device)
        bias.masked_fill_(self.mask == 0, float("-inf"))
        object.__setattr__(self, "bias", bias[self.group][:, None, None, :])

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    @classmethod
    def of(cls, cache: Any, mask: torch.Tensor, group: torch.Tensor) -> PrefixKV:
        """The prefill `cache` (one row per distinct prompt, `mask` `[groups, width]`) shared by
        slots whose distinct prompt is `group[slot]` (`[slots]` long)."""
        return cls([x.keys for x in cache.layers], [x.values for x in cache.layers], mask, group)

    def merge(self, other: PrefixKV) -> PrefixKV:
        """This batch's prefix then `other`'s (its slots after these, its groups after these),
        both left-padded to the wider of the two."""
        return PrefixKV(
            [cat_left_padded(a, b, 2) for a, b in zip(self.keys, other.keys, strict=True)],
            [cat_left_padded(a, b, 2) for a, b in zip(self.values, other.values, strict=True)],
            cat_left_padded(self.mask, other.mask, 1),
            torch.cat([self.group, other.group + self.mask.shape[0]]),
        )

    def select(self, index: torch.Tensor) -> PrefixKV:
        """Keep slots `index` (`[kept]` long), drop the groups none of them attends to, and the
        leading columns no kept group attends to."""
        group = self.group.index_select(0, index)
        used = torch.unique(group)  # sorted
        mask = self.mask.index_select(0, used)
        live = mask.any(dim=0).nonzero()
        first = int(live[0, 0]) if live.numel() else 0
        renumber = torch.full((self.mask.shape[0],), -1, dtype=torch.long, device=group.device)
        renumber[used] = torch.arange(used.numel(), device=group.device)
        if used.numel() == self.mask.shape[0]:
            keys, values = [k[:, :, first:] for k in self.keys], [v[:, :, first:] for v in self.values]
        else:
            keys = [k.index_select(0, used)[:, :, first:] for k in self.keys]
            values = [v.index_select(0, used)[:, :, first:] for v in self.values]
        return PrefixKV(keys, values, mask[:, first:], renumber[group])


def empty_suffix(config: Any, prefill: Any, rows: int, spare: int) -> Any:
    """A growing cache (`kv_cache`) of `rows` rows with no columns yet, `spare` columns to grow
    into: the suffix of a split batch. `prefill` (the prefill's cache) gives each layer's dtype,
    heads and head size; each layer's first update adopts its keys."""
    out = growing_cache(config)
    for layer, like in zip(out.layers, prefill.layers, strict=True):
        k, v = like.keys, like.values
        layer.lazy_initialization(k, v)
        layer.keys = k.new_empty((rows, k.shape[1], 0, k.shape[3]))
        layer.values = v.new_empty((rows, v.shape[1], 0, v.shape[3]))
        layer.spare = spare
    return out
