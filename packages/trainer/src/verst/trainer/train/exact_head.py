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
chunk is recomputed, the same bits). Only the forward must match the engine; gradients need no
particular bits. Measured (31.5M shape, 480 tokens, vocabulary 49,152, forward + backward):
747 ms through autograd, 623 ms here, 675 ms for the default chunked kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from verst.rollout.exact_ops import ROW_BLOCK, exact_linear, exact_logprobs

CHUNK_ROWS = 256
"""Rows per chunk (a multiple of `ROW_BLOCK`)."""
assert CHUNK_ROWS % ROW_BLOCK == 0


def _chunk_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, inv_temp: float
) -> torch.Tensor:
    """`[rows, V]` float32 log-probs of one chunk, the engine's bits."""
    return exact_logprobs(exact_linear(hidden, weight, bias), inv_temp)


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
        for s in range(0, n, CHUNK_ROWS):
            e = min(n, s + CHUNK_ROWS)
            logp = _chunk_logprobs(hidden[s:e], weight, bias, inv_temp)  # [rows, V]
            lp[s:e] = logp.gather(-1, target[s:e, None])[:, 0]
            ent[s:e] = -(logp.exp() * logp).sum(-1)
            if kept is not None:
                kept[s:e] = logp
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
        for s in range(0, n, CHUNK_ROWS):
            e = min(n, s + CHUNK_ROWS)
            logp = (
                dz_all[s:e]
                if dz_all is not None
                else _chunk_logprobs(hidden[s:e], weight, bias, ctx.inv_temp)
            )
            g = (None if g_lp is None else g_lp[s:e], None if g_ent is None else g_ent[s:e])
            dz = _dz(logp, ent[s:e], target[s:e], *g, ctx.inv_temp)  # [rows, V], in place
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
    ent: torch.Tensor,  # [rows]
    target: torch.Tensor,  # [rows]
    g_lp: torch.Tensor | None,  # [rows]
    g_ent: torch.Tensor | None,  # [rows]
    inv: float,
) -> torch.Tensor:
    """d loss / d logits of one chunk, written into `logp`:
    `p * ((logp + H) * -g_ent/T - g_lp/T)`, plus `g_lp/T` at the target."""
    if g_ent is not None:
        coef = torch.add(logp, ent[:, None]).mul_(g_ent[:, None] * -inv)  # [rows, V]
        if g_lp is not None:
            coef.sub_(g_lp[:, None] * inv)
    else:
        coef = g_lp[:, None] * -inv  # type: ignore[index]  # [rows, 1]
    dz = logp.exp_().mul_(coef)
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
