"""`torch.autograd.Function`s over the row operations (Triton or torch, chosen by the caller).

`LogprobsFunction` works on full logits `[N, V]`. `LinearLogprobsFunction` works on hidden states
`[N, H]` and the LM-head weight `[V, H]`: it processes `chunk_size` tokens at a time and never
holds more than one `[chunk, V]` block of logits, in the forward AND in the backward, where it
recomputes each chunk's logits (so any upstream gradient is handled correctly: see
docs/kernels.md, "Why recompute in the backward").
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class RowOps(Protocol):
    """The row-operation contract both backends implement (TorchRowOps, TritonRowOps)."""

    name: str

    @staticmethod
    def forward(
        logits: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        *,
        overwrite: bool = False,
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
    ) -> torch.Tensor: ...

    @staticmethod
    def topk(
        logits: torch.Tensor, k: int, temperature: float, lse: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def _no_autocast(t: torch.Tensor) -> torch.autocast:
    """The chunk matmuls run in the inputs' dtype: under an ambient autocast the forward would be
    cast while the backward's recompute would not, and the two would disagree."""
    return torch.autocast(device_type=t.device.type, enabled=False)


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
    """Chunked log-probs (and optional entropy / top-k) of `hidden @ weight.T / T`.

    Outputs: (log-probs [N, M], entropy [N] | None, lse [N], top-k values [N, k] | None,
    top-k indices [N, k] | None). Only log-probs and entropy are differentiable.
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
    ):
        N, M, dev = hidden.shape[0], targets.shape[1], hidden.device
        logprobs = torch.empty((N, M), dtype=torch.float32, device=dev)
        entropy = torch.empty((N,), dtype=torch.float32, device=dev) if with_entropy else None
        lse = torch.empty((N,), dtype=torch.float32, device=dev)
        top_v = torch.empty((N, topk), dtype=torch.float32, device=dev) if topk else None
        top_i = torch.empty((N, topk), dtype=torch.int64, device=dev) if topk else None
        for s in range(0, N, chunk_size):
            e = min(s + chunk_size, N)
            with _no_autocast(hidden):
                logits = hidden[s:e] @ weight.T  # [C, V], never more than one chunk alive
            lp_c, ent_c, lse_c = ops.forward(
                logits, targets[s:e], temperature, with_entropy, overwrite=not topk
            )  # top-k reads the logits afterwards: keep them intact then
            logprobs[s:e], lse[s:e] = lp_c, lse_c
            if entropy is not None:
                entropy[s:e] = ent_c
            if top_v is not None and top_i is not None:
                top_v[s:e], top_i[s:e] = ops.topk(logits, topk, temperature, lse_c)
            del logits, lp_c, ent_c, lse_c
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk_size, ctx.ops = temperature, chunk_size, ops
        ctx.mark_non_differentiable(*(t for t in (lse, top_v, top_i) if t is not None))
        ctx.set_materialize_grads(False)
        return logprobs, entropy, lse, top_v, top_i

    @staticmethod
    def backward(ctx: Any, grad_logprobs, grad_entropy, *_unused):  # type: ignore[override]
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        nones = (None,) * 6
        if (grad_logprobs is None and grad_entropy is None) or not (need_h or need_w):
            return None, None, *nones
        N, dev, T = hidden.shape[0], hidden.device, ctx.temperature
        if grad_logprobs is None:
            grad_logprobs = torch.zeros(targets.shape, dtype=torch.float32, device=dev)
        grad_logprobs = grad_logprobs.float().contiguous()
        if grad_entropy is not None:
            grad_entropy = grad_entropy.float().contiguous()
        low_precision = hidden.dtype != torch.float32
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if need_w else None  # [V, H]
        for s in range(0, N, ctx.chunk_size):
            e = min(s + ctx.chunk_size, N)
            h_c = hidden[s:e]  # [C, H]
            with _no_autocast(hidden):
                logits = h_c @ weight.T  # [C, V], recomputed with the forward's precision
            grad_logits = ctx.ops.backward(
                logits, targets[s:e], T, lse[s:e],
                entropy[s:e] if entropy is not None else None,
                grad_logprobs[s:e],
                grad_entropy[s:e] if grad_entropy is not None else None,
                torch.float32, overwrite=True,
            )  # fmt: skip  # [C, V] float32, may reuse the logits' buffer
            del logits
            if grad_h is not None:
                gl = grad_logits.to(hidden.dtype) if low_precision else grad_logits
                torch.mm(gl, weight, out=grad_h[s:e])
                del gl
            if grad_w is not None:  # accumulated across chunks in float32
                grad_w.addmm_(grad_logits.T, h_c.float() if low_precision else h_c)
            del grad_logits
        if grad_w is not None and low_precision:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, *nones
