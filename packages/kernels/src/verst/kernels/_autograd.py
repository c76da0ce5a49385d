"""`torch.autograd.Function`s over the row operations (Triton or torch, chosen by the caller).

`LogprobsFunction` works on full logits `[N, V]`. `LinearLogprobsFunction` works on hidden states
`[N, H]` and the LM-head weight `[V, H]`: it processes `chunk_size` tokens at a time (the row
kernels) or vocabulary tiles of as many elements (torch, `verst.kernels._tiles`) and never
holds more than one `[chunk, V]` block of logits, in the forward AND in the backward, where it
recomputes each block's logits (so any upstream gradient is handled correctly: see
docs/kernels.md, "Chunked linear path") — unless the caller's memory budget lets it keep the
forward's `[N, V]` logits for the backward (`keep=True`), which skips the recompute.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from verst.kernels._logits import TileLogits
from verst.kernels._tiles import tile_shape, tiled_backward, tiled_forward


class RowOps(Protocol):
    """The row-operation contract both backends implement (TorchRowOps, TritonRowOps)."""

    name: str
    uses_workspace: bool
    """Whether `workspace=` (a float32 `[rows, V]` buffer for temporaries) is used or ignored."""

    @staticmethod
    def forward(
        logits: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        *,
        overwrite: bool = False,
        workspace: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]: ...

    @staticmethod
    def backward(
        logits: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        lse: torch.Tensor,
        entropy: torch.Tensor | None,
        grad_logprobs: torch.Tensor,
        grad_entropy: torch.Tensor | None,
        out_dtype: torch.dtype,
        *,
        overwrite: bool = False,
        workspace: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    @staticmethod
    def topk(
        logits: torch.Tensor, k: int, temperature: float, lse: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class LogprobsFunction(torch.autograd.Function):
    """(log-probs [N, M], entropy [N] | None, lse [N]) of logits [N, V]; grads flow to logits."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,  # [N, V]
        targets: torch.Tensor,  # [N, M] int64
        temperature: float,
        with_entropy: bool,
        ops: RowOps,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        logprobs, entropy, lse = ops.forward(logits, targets, temperature, with_entropy)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature, ctx.ops = temperature, ops
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return logprobs, entropy, lse

    @staticmethod
    def backward(ctx: Any, grad_logprobs, grad_entropy, _grad_lse):  # type: ignore[override]
        logits, targets, lse, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[0] or (grad_logprobs is None and grad_entropy is None):
            return None, None, None, None, None
        if grad_logprobs is None:
            grad_logprobs = torch.zeros(targets.shape, dtype=torch.float32, device=logits.device)
        grad = ctx.ops.backward(
            logits, targets, ctx.temperature, lse, entropy,
            grad_logprobs.float().contiguous(),
            grad_entropy.float().contiguous() if grad_entropy is not None else None,
            logits.dtype,
        )  # fmt: skip
        return grad, None, None, None, None


class LinearLogprobsFunction(torch.autograd.Function):
    """Chunked log-probs (and optional entropy / top-k) of `post(hidden @ weight.T + bias) / T`.

    `post` is the optional soft-cap `cap * tanh(x / cap)` (Gemma-2/3 `final_logit_softcapping`),
    applied elementwise per chunk; a linear logit scale is the caller's to fold into the
    temperature. `keep=True` keeps every chunk's (pre-soft-cap) logits, `[N, V]` in the weight's
    dtype, from the forward for the backward instead of recomputing them there (the caller
    decides by a memory budget). Outputs: (log-probs [N, M], entropy [N] | None, lse [N], top-k
    values [N, k] | None, top-k indices [N, k] | None). Only log-probs and entropy are
    differentiable (wrt hidden, weight and bias).
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,  # [N, H]
        weight: torch.Tensor,  # [V, H]
        targets: torch.Tensor,  # [N, M] int64
        temperature: float,
        with_entropy: bool,
        chunk_size: int,
        ops: RowOps,
        topk: int,
        bias: torch.Tensor | None = None,  # [V]
        softcap: float | None = None,
        keep: bool = False,
    ):
        N, M, dev = hidden.shape[0], targets.shape[1], hidden.device
        logprobs = torch.empty((N, M), dtype=torch.float32, device=dev)
        entropy = torch.empty((N,), dtype=torch.float32, device=dev) if with_entropy else None
        lse = torch.empty((N,), dtype=torch.float32, device=dev)
        top_v = torch.empty((N, topk), dtype=torch.float32, device=dev) if topk else None
        top_i = torch.empty((N, topk), dtype=torch.int64, device=dev) if topk else None
        kept = weight.new_empty((N, weight.shape[0])) if keep else None  # [N, V]
        shape = _tile_shape(ops, N, weight.shape[0], chunk_size)
        chunks = TileLogits(hidden, weight, bias, softcap, shape[0] * shape[1], kept)
        out = (logprobs, entropy, lse, top_v, top_i)
        if ops.name == "torch":
            tiled_forward(chunks, targets, temperature, shape, keep, out)
        else:
            _rows_forward(chunks, ops, targets, temperature, shape[0], keep, out)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy, bias, kept)
        ctx.temperature, ctx.chunk_size, ctx.ops, ctx.softcap = temperature, chunk_size, ops, softcap
        ctx.mark_non_differentiable(*(t for t in (lse, top_v, top_i) if t is not None))
        ctx.set_materialize_grads(False)
        return logprobs, entropy, lse, top_v, top_i

    @staticmethod
    def backward(ctx: Any, grad_logprobs, grad_entropy, *_unused):  # type: ignore[override]
        hidden, weight, targets, lse, entropy, bias, kept = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[8]
        nones = (None,) * 6
        if (grad_logprobs is None and grad_entropy is None) or not (need_h or need_w or need_b):
            return None, None, *nones, None, None, None
        N, dev, T, ops = hidden.shape[0], hidden.device, ctx.temperature, ctx.ops
        if grad_logprobs is None:
            grad_logprobs = torch.zeros(targets.shape, dtype=torch.float32, device=dev)
        grad_logprobs = grad_logprobs.float().contiguous()
        if grad_entropy is not None:
            grad_entropy = grad_entropy.float().contiguous()
        low_precision = hidden.dtype != torch.float32
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.empty(weight.shape, dtype=torch.float32, device=dev) if need_w else None  # [V, H]
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=dev) if need_b else None  # [V]
        shape = _tile_shape(ops, N, weight.shape[0], ctx.chunk_size)
        chunks = TileLogits(hidden, weight, bias, ctx.softcap, shape[0] * shape[1], kept)
        saved = (targets, lse, entropy, grad_logprobs, grad_logprobs.sum(-1, keepdim=True), grad_entropy)
        if ops.name == "torch":
            tiled_backward(chunks, saved, T, shape, (grad_h, grad_w, grad_b))
        else:
            if grad_w is not None:
                grad_w.zero_()
            _rows_backward(chunks, ops, saved, T, shape[0], (grad_h, grad_w, grad_b))
        if grad_w is not None and low_precision:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None and bias is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, *nones, grad_b, None, None


def _accumulate(
    grad_logits: torch.Tensor,  # [C, V] float32
    h_c: torch.Tensor,  # [C, H]
    weight: torch.Tensor,  # [V, H]
    grad_h: torch.Tensor | None,  # [N, H]
    grad_w: torch.Tensor | None,  # [V, H] float32
    grad_b: torch.Tensor | None,  # [V] float32
    s: int,
    low_precision: bool,
) -> None:
    """One chunk's share of the gradients: `grad_h[s:s+C] = g @ W`, `grad_W += g.T @ h_c`,
    `grad_b += g.sum(0)` (accumulated across chunks in float32)."""
    if grad_b is not None:
        grad_b += grad_logits.sum(0)
    if grad_h is not None:
        gl = grad_logits.to(h_c.dtype) if low_precision else grad_logits
        torch.mm(gl, weight, out=grad_h[s : s + h_c.shape[0]])
        del gl
    if grad_w is not None:
        grad_w.addmm_(grad_logits.T, h_c.float() if low_precision else h_c)


def _tile_shape(ops: RowOps, n: int, v: int, chunk_size: int) -> tuple[int, int]:
    """Vocabulary tiles on the torch path; whole-row token chunks for the row kernels."""
    return tile_shape(n, v, chunk_size) if ops.name == "torch" else (min(chunk_size, max(n, 1)), v)


def _rows_forward(
    chunks: TileLogits,
    ops: RowOps,
    targets: torch.Tensor,
    temperature: float,
    rows: int,
    keep: bool,
    out: tuple,
) -> None:
    """The row kernels' forward, `rows` tokens (all of the vocabulary) at a time, into `out` =
    (log-probs, entropy | None, lse, top-k values | None, top-k ids | None)."""
    logprobs, entropy, lse, top_v, top_i = out
    N, V = targets.shape[0], chunks.weight.shape[0]
    for s in range(0, N, rows):
        e = min(s + rows, N)
        logits, _, own = chunks.compute(s, e, 0, V, keep=keep)  # [C, V]
        overwrite = own and top_v is None  # top-k reads the logits afterwards: keep them intact then
        lp_c, ent_c, lse_c = ops.forward(
            logits, targets[s:e], temperature, entropy is not None,
            overwrite=overwrite, workspace=chunks.workspace(ops, logits, overwrite),
        )  # fmt: skip
        logprobs[s:e], lse[s:e] = lp_c, lse_c
        if entropy is not None:
            entropy[s:e] = ent_c
        if top_v is not None and top_i is not None:
            top_v[s:e], top_i[s:e] = ops.topk(logits, top_v.shape[1], temperature, lse_c)
        del logits, lp_c, ent_c, lse_c


def _rows_backward(
    chunks: TileLogits, ops: RowOps, saved: tuple, temperature: float, rows: int, grads: tuple
) -> None:
    """The row kernels' backward, `rows` tokens at a time; `grads` = (grad_h, grad_W float32
    zeros, grad_b float32 zeros) | None each, accumulated across chunks."""
    targets, lse, entropy, grad_lp, _, grad_ent = saved
    grad_h, grad_w, grad_b = grads
    hidden, weight = chunks.hidden, chunks.weight
    low_precision = hidden.dtype != torch.float32
    N, V = hidden.shape[0], weight.shape[0]
    for s in range(0, N, rows):
        e = min(s + rows, N)
        # the forward's logits: kept (never written: a second backward reads them again) or
        # recomputed with the forward's precision; t = tanh(x / cap) under a soft-cap
        logits, t, own = chunks.compute(s, e, 0, V, keep=False)  # [C, V]
        grad_logits = ops.backward(
            logits, targets[s:e], temperature, lse[s:e],
            entropy[s:e] if entropy is not None else None, grad_lp[s:e],
            grad_ent[s:e] if grad_ent is not None else None,
            torch.float32, overwrite=own, workspace=chunks.workspace(ops, logits, own),
        )  # fmt: skip  # [C, V] float32, may reuse the logits' or the workspace's buffer
        del logits
        if t is not None:  # d cap*tanh(x/cap) / dx = 1 - tanh(x/cap)^2
            grad_logits.mul_(t.square_().neg_().add_(1.0))
            del t
        _accumulate(grad_logits, hidden[s:e], weight, grad_h, grad_w, grad_b, s, low_precision)
        del grad_logits
