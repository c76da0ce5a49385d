"""Batch-invariant CPU ops: one token's result is the same bits whatever else is in the call.

`train.exact_on_policy` runs the embedded engine's forwards and the trainer's through these, so a
response token's rollout log-prob equals the trainer's bit for bit (docs/training.md, "Exactly
on-policy"). What varies on CPU, measured with torch's MKL GEMM here (fp32, 1-4 threads), and the
fix each op takes:

- GEMM (`exact_linear`, attention's two matmuls): a row's result depends on the call's row
  count M — M = 1 takes a GEMV, M = 2-3 (or a thread's share of fewer than 4 rows) another
  kernel — and, for `q @ kᵀ`, on N < 16. From M a multiple of 8 and N >= 16 every row and
  column came out the same across M, N, the row's place in the call and 1-4 threads. So rows
  are padded to a multiple of `ROW_BLOCK` (zero rows, sliced off) and key columns to a
  multiple of `KEY_BLOCK`.
- The reduction over keys (softmax's sum and the weighted sum of values): its length is the
  cache length in a decode step, the row width in training. Both run as ONE GEMM
  `probs @ [values | 1]` whose inner dimension is the keys: up to 128 keys MKL accumulates that
  dimension in order (measured: 1-4 threads, any M, N, inner length 16-128 giving the same bits
  for the same keys with zeros anywhere between them; from 256 it does not), so masked keys
  (probability exactly 0, `exp(-inf)`) add nothing wherever they sit — left padding, another
  response's tokens in a shared-prompt row, trailing cache columns, holes. Longer rows are
  summed over fixed blocks of `KEY_BLOCK` key positions, in order (`_aligned_attention`); a
  call with at most `KEY_BLOCK` key columns has one block whatever its layout, so it runs
  without moving any key (`_one_block_attention`): the same bits as the blocked form.
- SiLU: torch's vectorised `silu` differs from its scalar tail in ~4% of values, so the
  element's place in the tensor mattered; `exact_silu` is `x / (1 + exp(-x))` from ops whose
  vector and scalar forms agree (exp, add, div: checked over 2^20 values).
- Log-probs: `log_softmax(logits * (1/T))` on both sides (the engine otherwise reports
  `scores - logsumexp`, the trainer's kernels divide by T: different roundings).
- MoE routers (`exact_router`): the router logits are `exact_linear` (transformers' routers call
  `F.linear` on their own weight, not an `nn.Linear`); softmax over the experts, top-k and the
  renormalisation are per token (checked). A replayed choice (`verst.rollout.moe.RouterHooks`)
  recomputes the weights with the same softmax, gathered at the ids in the recorded order, so
  the trainer's replayed weights are the engine's bits.
- MoE experts (`exact_experts`): transformers' experts kernels (`grouped_mm`, `batched_mm`, the
  eager loop's `F.linear`) see as many rows as the batch routed to an expert, so a token's
  result depended on the others; here each expert's rows go through `exact_linear` (row
  invariant) with `exact_silu`, are scaled by their gate weight, and are added into the output
  expert by expert in ascending id order (each token once per expert): a token's sum is the
  same additions in the same order whatever else is in the batch.
- Unchanged because already invariant (checked): RMSNorm's mean over the hidden size,
  log_softmax over the vocabulary, RoPE's cos/sin and products, embeddings, residual adds.

Imports torch only (both the engine and the trainer import it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

ROW_BLOCK = 8
"""Rows of every GEMM are padded to a multiple of this (M >= 8: no GEMV or small-M kernel)."""

KEY_BLOCK = 64
"""The weighted sum over keys runs over blocks of this many key positions (rows longer than this
are gathered into position order and padded to a multiple of it)."""

COL_BLOCK = 16
"""The attention's GEMMs have N a multiple of this: the score GEMM's key columns (padded) and
`[values | 1]`'s width (`_ones`). Measured: a column's bits then do not depend on N or on the
column's place (at 4 threads an N of 17, 33, 65 or 100 changed them)."""


def _pad_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    n = x.shape[dim]
    extra = (-n) % ROW_BLOCK if n else ROW_BLOCK
    if not extra:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _padded_linear(flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear` of `flat` `[n, in]` with its rows padded to a multiple of `ROW_BLOCK` → `[n, out]`."""
    n = flat.shape[0]
    padded = _pad_rows(flat, 0)
    out = F.linear(padded, weight)
    return out if padded.shape[0] == n else out[:n]


class _ExactLinear(torch.autograd.Function):
    """`_padded_linear` with a backward over the real rows only: `grad @ W` and `gradᵀ @ x` (the
    gradients need no particular bits), instead of autograd's zero-filled gradient of the padded
    output, its GEMMs over the padding and the slice back (for the LM head a `[tokens, vocab]`
    fill and copy per backward)."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(flat, weight)
        return _padded_linear(flat, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        flat, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad.T @ flat if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with the rows padded to a multiple of `ROW_BLOCK`: a row's
    output does not depend on how many other rows the call carries. x: [..., in] → [..., out]."""
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    grads = torch.is_grad_enabled() and (flat.requires_grad or weight.requires_grad)
    out = _ExactLinear.apply(flat, weight) if grads else _padded_linear(flat, weight)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


class _ExactSiLU(torch.autograd.Function):
    """`x / (1 + exp(-x))` in one autograd node: the forward's temporaries are updated in place
    and only `x` is kept; the backward is torch's `silu_backward` (gradients need not match any
    other side's bits, only the forward's log-probs do)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        den = torch.neg(x).exp_().add_(1.0)
        return torch.div(x, den, out=den)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad, x)


def exact_silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU from position-independent elementwise ops (see the module doc): `x / (1 + exp(-x))`,
    the same bits as those three ops one after another."""
    return _ExactSiLU.apply(x)


def exact_logprobs(logits: torch.Tensor, inv_temp: float | torch.Tensor) -> torch.Tensor:
    """`log_softmax(logits * inv_temp)` over the last dim (float32), the same op on both sides."""
    scores = logits.float()
    if not (isinstance(inv_temp, float) and inv_temp == 1.0):
        scores = scores * inv_temp
    return torch.log_softmax(scores, dim=-1)


def _allowed(mask: torch.Tensor | None, b: int, t: int, length: int, device: Any) -> torch.Tensor:
    """A bool `[b, t, L]` (True = attend) from transformers' mask: bool, additive, or None
    (causal, the queries being the last `t` of the `L` keys)."""
    if mask is None:
        q = torch.arange(length - t, length, device=device)[:, None]
        return (torch.arange(length, device=device)[None, :] <= q)[None].expand(b, t, length)
    if mask.dtype != torch.bool:
        mask = mask == 0
    return mask[:, 0, -t:, -length:].expand(b, t, length)


def _aligned(allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(index [b, L]: the column holding each row's c-th key, the mask in those coordinates
    [b, t, L]) when each row is one sequence: its last query's keys, in column order, are one
    chain of which every query sees a prefix (left padding, right padding, a cache, a cache with
    masked holes such as a split prompt's padding before a row's own tokens); None otherwise
    (packed or shared-prompt rows: `_chains`). Masked columns follow the keys in column order."""
    length = allowed.shape[-1]
    cols = torch.arange(length, device=allowed.device)
    last = allowed[:, -1]  # [b, L]
    index = torch.sort((~last).to(torch.int8), dim=-1, stable=True).indices  # keys first, in order
    count = allowed.sum(-1, keepdim=True)  # [b, t]
    ok = cols < count  # [b, t, L]
    gathered = allowed.gather(-1, index[:, None, :].expand_as(allowed))
    if not torch.equal(gathered, ok):
        return None
    return index, ok


NOT_ONE_SEQUENCE = (
    "exact_on_policy: a row of this attention is neither one contiguous causal sequence nor causal "
    "sequences whose queries each see a prefix of one chain of keys (packed and shared-prompt rows)"
)


@dataclass(frozen=True, slots=True)
class _Chains:
    """A training call's causal sequences laid out one per gathered row (`_chains`)."""

    index: torch.Tensor
    """`[n, width]`: the flat place (`row * T + column`) of each chain's keys in column order;
    `b * T` (a zero row appended to the flat call) past the chain's end."""
    lengths: torch.Tensor
    """`[n]`: keys per chain."""
    own: torch.Tensor
    """`[n, width]` bool: the query at that place is computed by this chain (each query by its
    first chain)."""


def _chains(allowed: torch.Tensor) -> _Chains:
    """A training row's causal sequences, when it holds several (packed rows, shared-prompt rows:
    `[prompt, resp_1, ..., resp_k]`). allowed: `[b, T, T]` (query i is key column i).

    A chain ends at a query no other query attends; its keys are that query's allowed columns,
    in column order, and every query at one of them must see exactly the keys before it in the
    chain (otherwise: ValueError, never approximated). Chains of 2+ keys are kept; each query is
    computed by its first chain. Queries in no such chain attend only themselves (a shared
    row's padding). Checked with a few whole-row ops per row (counts by one 0/1 GEMM: exact)."""
    b, width, _ = allowed.shape
    if not bool(allowed.diagonal(dim1=1, dim2=2).all()):
        raise ValueError(NOT_ONE_SEQUENCE)
    seen = allowed.sum(-1)  # [b, T]: keys per query
    causal = torch.ones(width, width, dtype=torch.bool, device=allowed.device).tril()
    found, rows, owns = [], [], []
    for row in range(b):
        a = allowed[row]  # [T, T]
        chains = a[(a.sum(0) == 1) & (seen[row] >= 2)]  # [m, T]: each end's keys
        rank = chains.cumsum(-1)  # [m, T]: a key's place in its chain, from 1
        before = ((a & causal).float() @ chains.T.float()).T  # [m, T]: query c's chain keys up to c
        fits = ((before == rank) & (seen[row] == rank)) | ~chains
        done = chains.any(0)
        if not bool(fits.all()) or not bool((done | (seen[row] == 1)).all()):
            raise ValueError(NOT_ONE_SEQUENCE)
        found.append(chains)
        owns.append(chains & (chains.cumsum(0) == 1))
        rows.append(torch.full((chains.shape[0],), row, device=allowed.device))
    chains, own, row_of = torch.cat(found), torch.cat(owns), torch.cat(rows)
    lengths = chains.sum(-1)
    longest = int(lengths.max()) if lengths.numel() else 0
    order = torch.sort((~chains).to(torch.int8), dim=-1, stable=True).indices[:, :longest]  # keys first
    inside = torch.arange(longest, device=allowed.device)[None, :] < lengths[:, None]
    index = torch.where(inside, row_of[:, None] * width + order, b * width)
    return _Chains(index, lengths, own.gather(-1, order) & inside)


def _gather_keys(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [b, kv, L, d] with its key columns reordered by index [b, L]."""
    b, kv, length, d = x.shape
    return x.gather(2, index[:, None, :, None].expand(b, kv, length, d))


def exact_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [b, heads, t, d]
    key: torch.Tensor,  # [b, kv_heads, L, d]
    value: torch.Tensor,  # [b, kv_heads, L, d]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns `([b, t, heads, d], None)`.

    A query's output is the same bits whatever the batch, the padding, the cache length and the
    other queries. Each row's keys are moved so that column c holds key position c (a gather:
    left padding and cache columns differ per row). Scores come from one GEMM (rows padded to
    `ROW_BLOCK`, columns to `KEY_BLOCK`), masked, minus their max (exact in any order), `exp`.
    The weighted sum of values and the softmax denominator come from GEMMs of the
    probabilities against `[values | 1]` over fixed blocks of `KEY_BLOCK` key positions,
    added block after block in position order: a query's blocks past its position add exact
    zeros, so neither the number of blocks nor where they end changes a bit (one GEMM over all
    keys would not do: MKL blocks its inner dimension by the total length)."""
    if dropout:
        raise ValueError("exact_on_policy: attention dropout is not batch-invariant; set it to 0")
    b, _, t, d = query.shape
    length = key.shape[2]
    scale = scaling if scaling is not None else d**-0.5
    if length <= KEY_BLOCK:
        return _one_block_attention(query, key, value, attention_mask, scale), None
    allowed = _allowed(attention_mask, b, t, length, query.device)
    aligned = _aligned(allowed)
    if aligned is not None:
        return _aligned_attention(query, key, value, *aligned, scale), None
    if t != length:  # a cache with several sequences per row: not a layout the engine makes
        raise ValueError(NOT_ONE_SEQUENCE)
    return _chained_attention(query, key, value, _chains(allowed), scale), None


def _chained_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chains: _Chains, scale: float
) -> torch.Tensor:
    """Rows of several causal sequences (`_chains`): each chain is gathered into a right-padded
    row of its own (one `index_select` of the flat call) and they run as one padded batch of
    `_aligned_attention`, so a query's bits are those of its sequence alone in a padded row (the
    trainer's default layout, the engine's decode). Each query's output comes from one chain (a
    shared prompt's queries from the first response's chain), put back by one `index_put`;
    queries that attend only themselves get their own value."""
    b, heads, t, d = query.shape
    rep = heads // key.shape[1]
    # a lone query's own value
    out = value.repeat_interleave(rep, dim=1).transpose(1, 2).reshape(b * t, heads, d)
    n, width = chains.index.shape
    if not n:
        return out.view(b, t, heads, d)
    flat_index = chains.index.reshape(-1)

    def gather(x: torch.Tensor) -> torch.Tensor:  # [b, h, t, d] -> [n, h, width, d], zeros past each end
        h = x.shape[1]
        flat = torch.cat([x.transpose(1, 2).reshape(b * t, h, d), x.new_zeros(1, h, d)])
        return flat.index_select(0, flat_index).view(n, width, h, d).transpose(1, 2)

    cols = torch.arange(width, device=query.device)
    last = chains.lengths[:, None, None]
    ok = (cols[None, None, :] <= cols[None, :, None]) & (cols[None, None, :] < last)  # [n, width, width]
    res = _aligned_attention(gather(query), gather(key), gather(value), None, ok, scale)  # [n, width, h, d]
    own = chains.own.reshape(-1)
    return out.index_put((flat_index[own],), res.reshape(n * width, heads, d)[own]).view(b, t, heads, d)


def _keys_t(keys: Sequence[torch.Tensor], rows: int) -> torch.Tensor:
    """The keys (parts `[b, kv, L_i, d]`, one after another) transposed and zero-padded to `rows`
    positions, `[b, kv, d, rows]` contiguous: what the score GEMM takes (written once)."""
    b, kv, _, d = keys[0].shape
    out = keys[0].new_empty((b, kv, d, rows))
    at = 0
    for part in keys:
        out[..., at : at + part.shape[2]] = part.transpose(-1, -2)
        at += part.shape[2]
    if at < rows:
        out[..., at:] = 0.0
    return out


def _ones(values: Sequence[torch.Tensor], rows: int) -> torch.Tensor:
    """`[values | 1]` (parts `[b, kv, L_i, d]`, one after another) padded with zero rows to `rows`
    keys: `[b, kv, rows, d + w]`, d + w a multiple of `COL_BLOCK` (its last w columns give the
    softmax's denominator)."""
    b, kv, _, d = values[0].shape
    w = COL_BLOCK - d % COL_BLOCK
    out = values[0].new_empty((b, kv, rows, d + w))
    at = 0
    for part in values:
        out[:, :, at : at + part.shape[2], :d] = part
        at += part.shape[2]
    out[:, :, :at, d:] = 1.0
    if at < rows:
        out[:, :, at:] = 0.0
    return out


def _stable_exp(scores: torch.Tensor) -> torch.Tensor:
    """`exp(scores - max)` over the last dim (the max is exact in any order; a fully masked row's
    -inf max is clamped, so its probabilities are 0, not NaN). The max carries no gradient: the
    softmax does not depend on it."""
    top = scores.detach().amax(-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).min)
    return torch.exp(scores - top)


def _masked(mask: torch.Tensor | None, t: int, length: int) -> torch.Tensor:
    """Where the queries must not see a key (True), `[b or 1, 1, t, length]`, from transformers'
    mask (bool: True = attend; additive: 0 = attend; None: causal, the queries the last `t` of
    the `length` keys)."""
    if mask is None:
        cols = torch.arange(length)
        return (cols[None, :] > torch.arange(length - t, length)[:, None])[None, None]
    mask = mask[:, :, -t:, -length:]
    return ~mask if mask.dtype == torch.bool else mask != 0


def _expand_heads(masked: torch.Tensor, rep: int, rows: int, width: int) -> torch.Tensor:
    """`masked` `[b, 1, t, L]` (True = masked) in the coordinates of the score GEMM, `[b, 1, rows,
    width]`: query row `r*t + i` (head group r, position i) takes position i's mask, padding
    rows (past `rep*t`) and the padding columns (past L) are masked. One query (`t = 1`) keeps a
    single row, broadcast over the heads and the padding rows (their results are sliced off)."""
    b, _, t, length = masked.shape
    if t > 1 and rep > 1:
        masked = masked[:, :, None].expand(b, 1, rep, t, length).reshape(b, 1, rep * t, length)
    extra_rows = rows - masked.shape[2] if masked.shape[2] > 1 else 0
    cols = width - length
    if cols or extra_rows:
        masked = F.pad(masked, (0, cols, 0, extra_rows), value=True)
    return masked


def _attend(
    query: torch.Tensor,  # [b, heads, t, d]
    keys: Sequence[torch.Tensor],  # parts [b, kv, L_i, d], one after another: the keys as the GEMMs take them
    values: Sequence[torch.Tensor],
    masked: torch.Tensor,  # [b or 1, 1, t, L or the padded width]: True = the query does not see the key
    scale: float,
    block: int | None,
) -> torch.Tensor:
    """The attention every path shares: query head `kv*rep + r`, position i is row `r*t + i` of
    its KV head's score GEMM (rows padded to `ROW_BLOCK`), masked, `_stable_exp`, then
    `probs @ [values | 1]` summed over blocks of `block` key positions in order (key columns
    padded to a multiple of it), or with `block` None as one GEMM over all the columns (padded
    to a multiple of `COL_BLOCK`) → `[b, t, heads, d]`."""
    b, heads, t, d = query.shape
    kv, length = keys[0].shape[1], sum(k.shape[2] for k in keys)
    rep = heads // kv
    width = length + (-length) % (block or COL_BLOCK)
    q = _pad_rows(query.reshape(b, kv, rep * t, d), 2)
    scores = torch.matmul(q, _keys_t(keys, width)) * scale  # [b, kv, Mp, width]
    probs = _stable_exp(scores.masked_fill(_expand_heads(masked, rep, q.shape[2], width), float("-inf")))
    vv = _ones(values, width)  # [b, kv, width, d + w]
    if block is None or block == width:  # one block: no slices (nor their backward's zero fills)
        acc = torch.matmul(probs, vv)
    else:
        acc = torch.matmul(probs[..., :block], vv[:, :, :block])
        for j in range(block, width, block):  # blocks of key positions, in order
            acc = acc + torch.matmul(probs[..., j : j + block], vv[:, :, j : j + block])
    if acc.shape[2] != rep * t:
        acc = acc[:, :, : rep * t]
    den = acc[..., d : d + 1]
    out = acc[..., :d] / torch.where(den > 0, den, torch.ones_like(den))  # 0 where a query saw no key
    return out.reshape(b, kv, rep, t, d).reshape(b, heads, t, d).transpose(1, 2).contiguous()


class DecodeStep:
    """One decode step's exact attention for every layer (`embedded.direct` under
    `train.exact_on_policy`): the step's mask is turned into the score GEMM's masked columns
    once, not per layer, and a layer's keys may come in parts (a split cache's prompt, then the
    row's own tokens), written straight into the GEMM's padded operands instead of joined first.
    The bits of `exact_attention` on the joined keys (the same `_attend`)."""

    def __init__(self, bias: torch.Tensor) -> None:
        """bias: the step's additive mask `[b, 1, 1, L]` (0 = attend), L the keys of every layer."""
        self.bias = bias
        self.length = bias.shape[-1]
        width = self.length + (-self.length) % COL_BLOCK
        self.masked = _expand_heads(bias != 0, 1, 1, width) if self.length <= KEY_BLOCK else None

    def __call__(
        self,
        query: torch.Tensor,  # [b, heads, 1, d]
        keys: Sequence[torch.Tensor],  # parts [b, kv, L_i, d], L in all
        values: Sequence[torch.Tensor],
        scale: float,
    ) -> torch.Tensor:
        """→ `[b, 1, heads, d]`."""
        if self.masked is not None:  # one block: `_one_block_attention`
            return _attend(query, keys, values, self.masked, scale, None)
        key = keys[0] if len(keys) == 1 else torch.cat(list(keys), dim=2)
        value = values[0] if len(values) == 1 else torch.cat(list(values), dim=2)
        return exact_attention(None, query, key, value, self.bias, scaling=scale)[0]


def _one_block_attention(
    query: torch.Tensor,  # [b, heads, t, d]
    key: torch.Tensor,  # [b, kv, L, d], L <= KEY_BLOCK
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """The attention of a call with at most `KEY_BLOCK` key columns, any layout: every query's
    keys lie in one block, so the weighted sum is one in-order GEMM over the columns as they sit
    (masked ones add exact zeros), the bits `_aligned_attention` gives the same query after
    moving its keys. Nothing is gathered; the mask is applied as given."""
    t, length = query.shape[2], key.shape[2]
    return _attend(query, [key], [value], _masked(mask, t, length), scale, None)


def _aligned_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    index: torch.Tensor | None,
    ok: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The attention of rows that are one sequence each (`_aligned`'s index and mask; index None:
    the keys already sit in position order)."""
    if index is not None:
        key, value = _gather_keys(key, index), _gather_keys(value, index)
    return _attend(query, [key], [value], ~ok[:, None], scale, KEY_BLOCK)


def exact_router(
    hidden: torch.Tensor, weight: torch.Tensor, top_k: int, renormalise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A softmax top-k MoE router (transformers' `*TopKRouter` forward) on batch-invariant ops.
    hidden `[N, H]`, weight `[E, H]` → (logits `[N, E]`, weights `[N, k]`, ids `[N, k]`)."""
    logits = exact_linear(hidden, weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), ids


def exact_experts(
    hidden: torch.Tensor,  # [N, H]
    top_k_index: torch.Tensor,  # [N, k]; ids outside [0, E) route nowhere
    top_k_weights: torch.Tensor,  # [N, k]
    gate_up_proj: torch.Tensor,  # [E, 2I, H]
    down_proj: torch.Tensor,  # [E, H, I]
) -> torch.Tensor:
    """Fused SiLU experts (transformers' `*Experts` forward) on batch-invariant ops: per expert
    hit, in ascending id order, `down(silu(gate) * up)` of its tokens times their gate weight,
    added into the output (see the module doc). Differentiable (the trainer backpropagates)."""
    out = torch.zeros_like(hidden)
    num = gate_up_proj.shape[0]
    hit = torch.unique(top_k_index)  # sorted
    for e in hit.tolist():
        if e < 0 or e >= num:
            continue
        token, slot = torch.where(top_k_index == e)  # a token at most once per expert
        gate, up = exact_linear(hidden[token], gate_up_proj[e]).chunk(2, dim=-1)
        part = exact_linear(exact_silu(gate) * up, down_proj[e]) * top_k_weights[token, slot, None]
        out = out.index_add(0, token, part.to(out.dtype))
    return out
