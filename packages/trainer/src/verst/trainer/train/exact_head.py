"""The exactly on-policy LM head: token log-probs (and entropy) with the engine's bits, and an
analytic backward.

The forward is what the exactly on-policy engine reports, `exact_logprobs(exact_linear(h, W) *
(1/T))`, over row chunks (a multiple of `ROW_BLOCK` rows each: `exact_linear` is row invariant,
so a chunk's rows have the bits of the whole call's). Autograd through those ops kept
`log_softmax`'s output, `exp(logp)` and `exp(logp) * logp` for the entropy, zero-filled a
`[N, V]` gradient for the gather and ran `log_softmax`'s backward: six passes over `[N, V]` for
what is one formula per chunk here,

    dz = g_lp * (onehot(target) - p) - g_ent * p * (logp + H),    z = logits / T,

with the forward's `logp` kept when `[N, V]` float32 fits `verst.kernels.KEEP_LOGITS_MAX_BYTES`
(the backward turns it into `dz` in place and runs one GEMM per gradient over all rows; else each
chunk is recomputed, the same bits). Only the forward's log-probs must match the engine; the
entropy and the gradients need no particular bits. A chunk's logits, log-probs and `exp` live in
two `[rows, V]` tiles reused by every chunk (`_Tiles`: on CPU a fresh allocation of that size is
fresh pages, faulted in on first write). Measured (31.5M shape: 512 tokens, vocabulary 49,152,
2 threads, forward + backward, median of 16 interleaved calls on a noisy box): 772 ms here
against 750 ms for the default chunked kernel; with a fresh `[rows, V]` tensor per op and five
passes in the backward it was 811 against 672 ms.
"""

from __future__ import annotations

from typing import Any

import torch

from verst.rollout.exact_ops import ROW_BLOCK

CHUNK_ROWS = 256
"""Rows per chunk (a multiple of `ROW_BLOCK`). Fewer rows per GEMM cost more: at the 31.5M shape
(hidden 384, vocabulary 49,152, 2 threads) the forward's GEMMs over 512 rows took ~1.5x as long
in chunks of 64 rows as in chunks of 256."""
assert CHUNK_ROWS % ROW_BLOCK == 0


class _Tiles:
    """One chunk's `[rows, V]` float32 tiles, reused by every chunk (a fresh CPU allocation of that
    size is fresh pages, faulted in on first write)."""

    def __init__(self, n: int, v: int, like: torch.Tensor) -> None:
        """For `n` rows in chunks of `CHUNK_ROWS` (each padded to a multiple of `ROW_BLOCK`)."""
        rows = min(n, CHUNK_ROWS)
        rows += (-rows) % ROW_BLOCK
        self.a = like.new_empty((rows, v), dtype=torch.float32)
        self.b = like.new_empty((rows, v), dtype=torch.float32)

    def logprobs(
        self,
        hidden: torch.Tensor,  # [rows, H], rows <= CHUNK_ROWS
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        inv_temp: float,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """The chunk's log-probs, the engine's bits: `exact_logprobs(exact_linear(h, W, b), 1/T)`
        (the same mm on the rows padded to `ROW_BLOCK`, the bias added after it, the scaling,
        `log_softmax` over whole rows), written into `out` (None: a tile)."""
        rows = hidden.shape[0]
        extra = (-rows) % ROW_BLOCK
        if extra:
            hidden = torch.cat([hidden, hidden.new_zeros(extra, hidden.shape[1])])
        z = torch.mm(hidden, weight.T, out=self.a[: rows + extra])[:rows]
        if bias is not None:
            z.add_(bias)
        if inv_temp != 1.0:
            z.mul_(inv_temp)
        return torch.log_softmax(z, dim=-1, out=self.b[:rows] if out is None else out)

    def entropy(self, logp: torch.Tensor) -> torch.Tensor:
        """`-sum(p * logp)` per row (a metric and a loss term: no particular bits needed)."""
        p = torch.exp(logp, out=self.a[: logp.shape[0]])
        return torch.linalg.vecdot(p, logp).neg_()


class _ExactHead(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,  # [N, H]
        weight: torch.Tensor,  # [V, H]
        bias: torch.Tensor | None,  # [V]
        target: torch.Tensor,  # [N]
        inv_temp: float,
        keep_bytes: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, v = hidden.shape[0], weight.shape[0]
        kept = hidden.new_empty((n, v), dtype=torch.float32) if n * v * 4 <= keep_bytes else None
        lp = hidden.new_empty(n, dtype=torch.float32)
        ent = hidden.new_empty(n, dtype=torch.float32)
        tiles = _Tiles(n, v, hidden)
        for s in range(0, n, CHUNK_ROWS):
            e = min(n, s + CHUNK_ROWS)
            logp = tiles.logprobs(hidden[s:e], weight, bias, inv_temp, None if kept is None else kept[s:e])
            lp[s:e] = logp.gather(-1, target[s:e, None])[:, 0]
            ent[s:e] = tiles.entropy(logp)
        ctx.save_for_backward(hidden, weight, bias, target, ent)
        ctx.set_materialize_grads(False)  # an unused entropy's gradient stays None
        ctx.inv_temp, ctx.kept = inv_temp, kept  # not saved: the backward overwrites it, once
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None) -> tuple[Any, ...]:
        hidden, weight, bias, target, ent = ctx.saved_tensors
        n = hidden.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if g_lp is None and g_ent is None:
            zeros = (
                hidden.new_zeros(hidden.shape) if need_h else None,
                torch.zeros_like(weight) if need_w else None,
            )
            return *zeros, torch.zeros_like(bias) if need_b else None, None, None, None
        # the kept log-probs become dz in place, once (a second backward, retain_graph, recomputes)
        dz_all, ctx.kept = ctx.kept, None
        grad_h = torch.empty_like(hidden) if need_h and dz_all is None else None
        grad_w = torch.zeros_like(weight) if need_w and dz_all is None else None
        grad_b = torch.zeros_like(bias) if need_b and dz_all is None else None
        tiles = _Tiles(n, weight.shape[0], hidden)
        for s in range(0, n, CHUNK_ROWS):
            e = min(n, s + CHUNK_ROWS)
            logp = (
                dz_all[s:e]
                if dz_all is not None
                else tiles.logprobs(hidden[s:e], weight, bias, ctx.inv_temp, None)
            )
            g = (None if g_lp is None else g_lp[s:e], None if g_ent is None else g_ent[s:e])
            dz = _dz(logp, tiles.a[: e - s], ent[s:e], target[s:e], *g, ctx.inv_temp)  # [rows, V], in place
            if grad_h is not None:
                grad_h[s:e] = dz @ weight
            if grad_w is not None:
                grad_w.addmm_(dz.T, hidden[s:e])
            if grad_b is not None:
                grad_b += dz.sum(0)
        if dz_all is not None:  # one GEMM each over all rows
            grad_h = dz_all @ weight if need_h else None
            grad_w = dz_all.T @ hidden if need_w else None
            grad_b = dz_all.sum(0) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None


def _dz(
    logp: torch.Tensor,  # [rows, V], overwritten
    p: torch.Tensor,  # [rows, V], a workspace
    ent: torch.Tensor,  # [rows]
    target: torch.Tensor,  # [rows]
    g_lp: torch.Tensor | None,  # [rows]
    g_ent: torch.Tensor | None,  # [rows]
    inv: float,
) -> torch.Tensor:
    """d loss / d logits of one chunk, written into `logp`: `p * (logp * a + c)` with
    `a = -g_ent/T`, `c = a * H - g_lp/T` (from `p * ((logp + H) * -g_ent/T - g_lp/T)`), plus
    `g_lp/T` at the target."""
    p = torch.exp(logp, out=p)
    if g_ent is not None:
        a = g_ent * -inv
        c = a * ent if g_lp is None else a * ent - g_lp * inv
        dz = logp.mul_(a[:, None]).add_(c[:, None]).mul_(p)
    else:
        dz = torch.mul(p, (g_lp * -inv)[:, None], out=logp)  # type: ignore[operator]
    if g_lp is not None:
        dz.scatter_add_(1, target[:, None], g_lp[:, None] * inv)
    return dz


def exact_head_logprobs(
    hidden: torch.Tensor,  # [N, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,
    target_ids: torch.Tensor,  # [N]
    temperature: float,
    *,
    keep_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs `[N]`, entropy `[N]`) of `target_ids` under `softmax(exact_linear(h, W) / T)`,
    the exactly on-policy engine's bits. `keep_bytes`: keep the forward's `[N, V]` log-probs for
    the backward up to this size (None = `verst.kernels.KEEP_LOGITS_MAX_BYTES`)."""
    if keep_bytes is None:
        from verst.kernels import KEEP_LOGITS_MAX_BYTES

        keep_bytes = KEEP_LOGITS_MAX_BYTES
    return _ExactHead.apply(hidden, weight, bias, target_ids, 1.0 / temperature, keep_bytes)
