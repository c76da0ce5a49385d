"""The embedded engine's prefill: distinct prompts through the model in groups of similar length.

One left-padded forward over prompts of mixed lengths runs every padding position through every
layer (64 prompts of 16–64 tokens: 4,096 positions for ~2,400 tokens). `prefill` orders the
prompts longest first, splits them into contiguous groups of similar length
(`ragged.split_by_width`: padding saved against a forward's fixed cost), runs one `model(...)`
forward per group — LoRA routing, MoE router recording and image features per group, as for one
forward — and stacks the groups' KV caches, each row back in its place, into one left-padded
cache (`kv_cache.stack_caches`, one copy). Each row's positions, cache columns and logits are
the ones a single padded forward computes, up to float rounding (the same modules on the same
tokens; padding is masked either way; tested to 1e-5). One group is one forward over the rows as
given, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verst.rollout.engines.embedded.kv_cache import growing_cache, stack_caches
from verst.rollout.engines.embedded.ragged import split_by_width
from verst.rollout.engines.embedded.vision import prefill_kwargs


@dataclass(slots=True)
class Prefilled:
    """The prefill of some prompts, row by row in the order given."""

    cache: Any
    """Their KV cache (left-padded to the longest prompt)."""
    mask: torch.Tensor  # [rows, width] long
    """1 = a prompt token, 0 = left padding."""
    last: torch.Tensor  # [rows, vocab]
    """The logits at each prompt's last position."""
    logits: list[torch.Tensor] | None
    """With `full`: each row's logits at every prompt position (`[prompt_len, vocab]`)."""
    routing: list[torch.Tensor] | None
    """MoE models: each row's expert choices at every prompt position (`[prompt_len, layers × k]`)."""


@dataclass(slots=True)
class PrefillModel:
    """What a prefill forward needs of the engine's batch."""

    model: Any
    pad_id: int
    device: Any
    vision: Any
    """The `MultimodalProcessor` of a vision-language model (None: text only)."""
    routers: Any
    """`RouterHooks` of a MoE model (None: dense)."""
    route: Callable[[list[Any]], None]
    """Tells LoRA adapters which rows the next forward carries."""


def prefill(m: PrefillModel, rows: Sequence[Any], spare: int, full: bool, group_cost: float) -> Prefilled:
    """Prefill `rows` (one per distinct prompt) in groups of similar length; the cache keeps
    `spare` free columns. `full`: keep every position's logits, else only the last."""
    lens = [r.prompt_len for r in rows]
    order = sorted(range(len(rows)), key=lambda i: -lens[i])  # longest first (stable)
    groups = split_by_width([lens[i] for i in order], group_cost)
    if len(groups) == 1:
        order = list(range(len(rows)))  # one forward over the rows as given
    places = [order[lo:hi] for lo, hi in groups]  # each group's rows
    parts = [_forward(m, [rows[i] for i in at], spare if len(groups) == 1 else 1, full) for at in places]
    width = max(lens)
    if len(parts) == 1:
        cache = parts[0][0]
    else:
        for layer in parts[0][0].layers:
            layer.spare = spare
        index = [torch.tensor(at, device=m.device) for at in places]
        cache = stack_caches([c for c, _, _ in parts], index, len(rows), width)
    mask = _left_padded_mask(lens, width)  # [rows, width]
    where: list[tuple[int, int]] = [(0, 0)] * len(rows)  # row → (group, its row in the group)
    flat = [0] * len(rows)  # row → its row in the groups' rows one after another
    for k, (g, j, i) in enumerate((g, j, i) for g, at in enumerate(places) for j, i in enumerate(at)):
        where[i], flat[i] = (g, j), k
    last = torch.cat([logits[:, -1] for _, logits, _ in parts])  # [rows in group order, vocab]
    return Prefilled(
        cache,
        mask.to(m.device),
        last if len(parts) == 1 else last[torch.tensor(flat, device=m.device)],
        _per_row([logits for _, logits, _ in parts], where, lens) if full else None,
        None if m.routers is None else _per_row([routed for _, _, routed in parts], where, lens),
    )


def _left_padded_mask(lens: list[int], width: int) -> torch.Tensor:
    """`[rows, width]` long: 1 over each row's last `lens[i]` columns (its prompt), 0 before."""
    return (torch.arange(width) >= width - torch.tensor(lens)[:, None]).long()


def _per_row(parts: list[torch.Tensor], where: list[tuple[int, int]], lens: list[int]) -> list[torch.Tensor]:
    """Each row's last `lens[i]` positions of its group's `[rows, width, ...]` tensor."""
    return [parts[g][j, parts[g].shape[1] - n :] for (g, j), n in zip(where, lens, strict=True)]


def _forward(m: PrefillModel, rows: Sequence[Any], spare: int, full: bool) -> tuple[Any, torch.Tensor, Any]:
    """One left-padded forward over `rows` → (cache, logits `[rows, width or 1, vocab]`,
    routing `[rows, width, layers × k]` or None)."""
    lens = [r.prompt_len for r in rows]
    width = max(lens)
    ids = torch.full((len(rows), width), m.pad_id, dtype=torch.long)  # [rows, width]
    for i, r in enumerate(rows):
        ids[i, width - lens[i] :] = torch.tensor(r.request.input_ids)
    mask = _left_padded_mask(lens, width)  # [rows, width]
    ids, mask = ids.to(m.device), mask.to(m.device)
    pos = (mask.cumsum(1) - 1).clamp(min=0)  # [rows, width]
    cache = growing_cache(m.model.config)
    for layer in cache.layers:
        layer.spare = spare
    m.route(list(rows))
    out = m.model(
        **prefill_kwargs(m.vision, m.model, ids, rows),
        attention_mask=mask,
        position_ids=pos,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=0 if full else 1,
    )
    routed = None if m.routers is None else m.routers.take_rows().reshape(len(rows), width, -1)
    return cache, out.logits, routed
