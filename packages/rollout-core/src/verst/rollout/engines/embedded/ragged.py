"""Groups of prompts of similar length, so that left padding costs less.

A left-padded prefill computes every prompt at the longest prompt's width, running every padding
position through every layer. Splitting the prompts (longest first) into contiguous groups, each
padded only to its own longest prompt, trades that padding for one more forward per group.
`split_by_width` picks the groups that minimise padding plus a fixed cost per group.

The cost of a group is a rough estimate of a forward's fixed cost in padded tokens (measured on
CPU at the tiny test model: a forward ≈ 4 ms, a token ≈ 45 µs, so ≈ 90 tokens); on an accelerator
a forward's fixed cost weighs far more against a token's, so the default splits much less.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

PREFILL_GROUP_TOKENS = {"cpu": 96.0}
"""One more prefill forward costs about this many padded tokens (per device type)."""
PREFILL_GROUP_TOKENS_OTHER = 2048.0
"""... on other devices (accelerators)."""
MAX_SPAN = 64
"""A group covers at most this many runs of equal width (bounds the search at O(runs × MAX_SPAN))."""


def split_by_width(widths: Sequence[int], group_cost: float) -> list[tuple[int, int]]:
    """Contiguous ranges `[lo, hi)` covering `widths` in order, minimising the padding
    `Σ_groups Σ_i (max(group) − widths[i])` plus `group_cost` per group. Neighbours of equal
    width stay together; a group spans at most `MAX_SPAN` runs of equal width (an infinite
    `group_cost`: one group)."""
    if math.isinf(group_cost):
        return [(0, len(widths))] if widths else []
    runs: list[tuple[int, int]] = []  # (width, rows) of each run of equal neighbours
    for w in widths:
        if runs and runs[-1][0] == w:
            runs[-1] = (w, runs[-1][1] + 1)
        else:
            runs.append((w, 1))
    if not runs:
        return []
    rows, total = [0], [0]  # prefix sums over runs: rows, Σ widths
    for w, n in runs:
        rows.append(rows[-1] + n)
        total.append(total[-1] + w * n)
    best, cut = [0.0] + [float("inf")] * len(runs), [0] * (len(runs) + 1)
    for j in range(1, len(runs) + 1):
        widest = 0
        for i in range(j - 1, max(-1, j - 1 - MAX_SPAN), -1):  # group = runs[i:j]
            widest = max(widest, runs[i][0])
            cost = best[i] + widest * (rows[j] - rows[i]) - (total[j] - total[i]) + group_cost
            if cost <= best[j]:  # on a tie the longer group: fewer calls
                best[j], cut[j] = cost, i
    bounds, j = [], len(runs)
    while j > 0:
        bounds.append((rows[cut[j]], rows[j]))
        j = cut[j]
    return bounds[::-1]


def prefill_group_tokens(device: Any) -> float:
    """`split_by_width`'s cost of one more prefill forward on `device`, in padded tokens."""
    return PREFILL_GROUP_TOKENS.get(getattr(device, "type", str(device)), PREFILL_GROUP_TOKENS_OTHER)
