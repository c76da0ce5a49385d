"""Groups of rows of similar width, so that left padding costs less.

A left-padded batch computes every row at its widest row's width: a prefill runs every padding
position through every layer, and a decode step's attention reads every padding column of the
KV cache. Splitting the rows into contiguous groups, each padded (or attended) only to its own
widest row, trades that padding for one more call per group. `split_by_width` picks the groups
that minimise padding plus a fixed cost per group; the engine keeps a batch's rows longest
prompt first, so the groups it finds are tight.

The costs per group are rough estimates of the call's fixed cost in units of padding (measured
on CPU at the tiny test model: a prefill forward ≈ 90 tokens' work, an attention call ≈ 100
cache columns' reads of a row). On an accelerator a call's fixed cost weighs more, so the
defaults split much less.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PREFILL_GROUP_TOKENS = {"cpu": 96.0}
"""One more prefill forward costs about this many padded tokens (per device type)."""
PREFILL_GROUP_TOKENS_OTHER = 2048.0
"""... on other devices (accelerators)."""
ATTENTION_GROUP_BYTES = {"cpu": 128 << 10}
"""One more attention call costs about reading this many bytes of KV cache (per device type)."""
ATTENTION_GROUP_BYTES_OTHER = 32 << 20
"""... on other devices (accelerators)."""
MAX_SPAN = 64
"""A group covers at most this many runs of equal width (bounds the search at O(runs × MAX_SPAN))."""


def split_by_width(widths: Sequence[int], group_cost: float) -> list[tuple[int, int]]:
    """Contiguous ranges `[lo, hi)` covering `widths` in order, minimising the padding
    `Σ_groups Σ_i (max(group) − widths[i])` plus `group_cost` per group. Neighbours of equal
    width stay together; a group spans at most `MAX_SPAN` runs of equal width."""
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


def attention_group_columns(device: Any, kv_heads: int, head_dim: int, element_size: int) -> float:
    """`split_by_width`'s cost of one more attention call on `device`, in cache columns of one
    row (keys and values of every KV head)."""
    per_column = 2 * kv_heads * head_dim * element_size
    budget = ATTENTION_GROUP_BYTES.get(getattr(device, "type", str(device)), ATTENTION_GROUP_BYTES_OTHER)
    return budget / max(1, per_column)


def attention_segments(mask: Any, group_cost: float) -> list[tuple[int, int, int]] | None:
    """Row groups of a left-padded `[rows, cols]` 0/1 mask for a decode step's attention:
    `(lo, hi, start)` — rows `lo:hi` attend only from column `start`, the group's earliest
    attended column; None when one group over all columns is best."""
    rows, cols = mask.shape
    if rows < 2:
        return None
    starts = mask.ne(0).int().argmax(1).tolist()  # each row's first attended column (0 if none)
    widths = [cols - s for s in starts]
    groups = split_by_width(widths, group_cost)
    if len(groups) < 2:
        return None
    return [(lo, hi, min(starts[lo:hi])) for lo, hi in groups]
