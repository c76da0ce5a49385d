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


def _chunk_logits(
    h_c: torch.Tensor,  # [C, H]
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V]
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's logits `[C, V]` after the optional bias and soft-cap, and `tanh(x / cap)`
    (float32, the soft-cap's derivative needs it) or None without a soft-cap."""
    with _no_autocast(h_c):
        logits = h_c @ weight.T  # [C, V], never more than one chunk alive
        if bias is not None:
            logits += bias
    if softcap is None:
        return logits, None
    t = logits.float().div_(softcap).tanh_()  # [C, V] float32
    return t * softcap, t


class LinearLogprobsFunction(torch.autograd.Function):
    """Chunked log-probs (and optional entropy / top-k) of `post(hidden @ weight.T + bias) / T`.

    `post` is the optional soft-cap `cap * tanh(x / cap)` (Gemma-2/3 `final_logit_softcapping`),
    applied elementwise per chunk (forward and backward recompute); a linear logit scale is the
    caller's to fold into the temperature. Outputs: (log-probs [N, M], entropy [N] | None, lse [N],
    top-k values [N, k] | None, top-k indices [N, k] | None). Only log-probs and entropy are
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
    ):
        N, M, dev = hidden.shape[0], targets.shape[1], hidden.device
        logprobs = torch.empty((N, M), dtype=torch.float32, device=dev)
        entropy = torch.empty((N,), dtype=torch.float32, device=dev) if with_entropy else None
        lse = torch.empty((N,), dtype=torch.float32, device=dev)
        top_v = torch.empty((N, topk), dtype=torch.float32, device=dev) if topk else None
        top_i = torch.empty((N, topk), dtype=torch.int64, device=dev) if topk else None
        for s in range(0, N, chunk_size):
            e = min(s + chunk_size, N)
            logits, _ = _chunk_logits(hidden[s:e], weight, bias, softcap)  # [C, V]
            lp_c, ent_c, lse_c = ops.forward(
                logits, targets[s:e], temperature, with_entropy, overwrite=not topk
            )  # top-k reads the logits afterwards: keep them intact then
            logprobs[s:e], lse[s:e] = lp_c, lse_c
            if entropy is not None:
                entropy[s:e] = ent_c
            if top_v is not None and top_i is not None:
                top_v[s:e], top_i[s:e] = ops.topk(logits, topk, temperature, lse_c)
            del logits, lp_c, ent_c, lse_c
        ctx.save_for_backward(hidden, weight, targets, lse, entropy, bias)
        ctx.temperature, ctx.chunk_size, ctx.ops, ctx.softcap = temperature, chunk_size, ops, softcap
        ctx.mark_non_differentiable(*(t for t in (lse, top_v, top_i) if t is not None))
        ctx.set_materialize_grads(False)
        return logprobs, entropy, lse, top_v, top_i

    @staticmethod
    def backward(ctx: Any, grad_logprobs, grad_entropy, *_unused):  # type: ignore[override]
        hidden, weight, targets, lse, entropy, bias = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[8]
        nones = (None,) * 6
        if (grad_logprobs is None and grad_entropy is None) or not (need_h or need_w or need_b):
            return None, None, *nones, None, None
        N, dev, T = hidden.shape[0], hidden.device, ctx.temperature
        if grad_logprobs is None:
            grad_logprobs = torch.zeros(targets.shape, dtype=torch.float32, device=dev)
        grad_logprobs = grad_logprobs.float().contiguous()
        if grad_entropy is not None:
            grad_entropy = grad_entropy.float().contiguous()
        low_precision = hidden.dtype != torch.float32
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if need_w else None  # [V, H]
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=dev) if need_b else None  # [V]
        for s in range(0, N, ctx.chunk_size):
            e = min(s + ctx.chunk_size, N)
            h_c = hidden[s:e]  # [C, H]
            # recomputed with the forward's precision; t = tanh(x / cap) under a soft-cap
            logits, t = _chunk_logits(h_c, weight, bias, ctx.softcap)  # [C, V]
            grad_logits = ctx.ops.backward(
                logits, targets[s:e], T, lse[s:e],
                entropy[s:e] if entropy is not None else None,
                grad_logprobs[s:e],
                grad_entropy[s:e] if grad_entropy is not None else None,
                torch.float32, overwrite=True,
            )  # fmt: skip  # [C, V] float32, may reuse the logits' buffer
            del logits
            if t is not None:  # d cap*tanh(x/cap) / dx = 1 - tanh(x/cap)^2
                grad_logits.mul_(t.square_().neg_().add_(1.0))
                del t
            if grad_b is not None:
                grad_b += grad_logits.sum(0)
            if grad_h is not None:
                gl = grad_logits.to(hidden.dtype) if low_precision else grad_logits
                torch.mm(gl, weight, out=grad_h[s:e])
                del gl
            if grad_w is not None:  # accumulated across chunks in float32
                grad_w.addmm_(grad_logits.T, h_c.float() if low_precision else h_c)
            del grad_logits
        if grad_w is not None and low_precision:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None and bias is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, *nones, grad_b, None
