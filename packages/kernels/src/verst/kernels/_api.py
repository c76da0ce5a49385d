"""Public functions: validate and flatten inputs, pick the backend, call the autograd Functions."""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch

from verst.kernels._autograd import LinearLogprobsFunction, LogprobsFunction, RowOps
from verst.kernels._dispatch import Backend, resolve_backend
from verst.kernels._torch_impl import TorchRowOps

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

KEEP_LOGITS_MAX_BYTES = 256 * 1024 * 1024
"""Default budget of the `linear_*` functions' `keep_logits_max_bytes`: the forward keeps a call's
`[N, V]` logits (the weight's dtype) for the backward, instead of recomputing them chunk by chunk
there, when they take at most this many bytes (256 MiB: e.g. 1,365 tokens x a 49,152 vocabulary
in float32; never at 4,096 x 151,936)."""


class TopKLogprobs(NamedTuple):
    """Result of `topk_logprobs` / `linear_topk_logprobs` (all float32 / int64)."""

    values: torch.Tensor
    """[..., k] the k largest log-probs per row, descending (not differentiable)."""
    indices: torch.Tensor
    """[..., k] their vocabulary ids (int64)."""
    token_logprobs: torch.Tensor | None
    """[..., m] log-probs of the requested `token_ids` (differentiable), or None when not asked."""


def _row_ops(device: torch.device, backend: Backend | None) -> RowOps:
    if resolve_backend(device, backend) == "triton":
        from verst.kernels._launchers import TritonRowOps  # imports triton: only when selected

        return TritonRowOps
    return TorchRowOps


def _check_temperature(temperature: float) -> float:
    t = float(temperature)
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return t


def _check_float(name: str, x: torch.Tensor, min_dim: int = 1) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} dtype {x.dtype} is not supported; valid: float32, bfloat16, float16")
    if x.dim() < min_dim or x.shape[-1] == 0:
        raise ValueError(f"{name} must have a non-empty last dimension, got shape {tuple(x.shape)}")


def _rows(x: torch.Tensor, *, strided: bool = False) -> torch.Tensor:
    """[..., D] -> [N, D] with unit stride along D; a view whenever one exists.

    `strided=True` (the Triton row kernels, which take two row strides): when no `[N, D]` view
    exists, e.g. `logits[:, :-1]` of a `[B, T+1, V]` tensor, return a `[B', T, D]` view instead
    of copying every logit (`reshape` would copy silently).
    """
    D = x.shape[-1]
    if x.dim() > 1 and x.stride(-1) == 1:
        try:
            return x.view(-1, D)
        except RuntimeError:
            if strided and x.dim() >= 3:
                with contextlib.suppress(RuntimeError):
                    return x.view(-1, x.shape[-2], D)
    x2 = x.reshape(-1, D)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _check_ids(
    name: str, ids: torch.Tensor, lead: torch.Size, V: int, device: torch.device, extra: bool
) -> torch.Tensor:
    """Validate ids of shape `lead` (or `lead + [m]` when `extra`) and return them as [N, M] int64."""
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {getattr(ids, 'dtype', type(ids).__name__)}")
    want = f"{tuple(lead)} + (m,)" if extra else f"{tuple(lead)}"
    shape_ok = ids.shape[:-1] == lead if extra else ids.shape == lead
    if ids.dim() != len(lead) + int(extra) or not shape_ok:
        raise ValueError(
            f"{name} must have shape {want} (the leading dims of the input), got {tuple(ids.shape)}"
        )
    if ids.device != device:
        raise ValueError(f"{name} is on {ids.device} but the input is on {device}; move them together")
    if ids.numel() and bool(((ids < 0) | (ids >= V)).any()):  # one host sync
        raise ValueError(f"{name} must lie in [0, V={V}), got values in [{int(ids.min())}, {int(ids.max())}]")
    return ids.reshape(-1, ids.shape[-1] if extra else 1).to(torch.int64).contiguous()


def token_logprobs(
    logits: torch.Tensor,  # [..., V]
    target_ids: torch.Tensor,  # [...]
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    backend: Backend | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(logits / T)[target_ids] as float32 `[...]`, and the entropy `[...]` when asked.

    Differentiable wrt `logits` (also through the entropy). `backend=None` picks Triton on CUDA
    when available and torch otherwise; "triton"/"torch" force one.
    """
    _check_float("logits", logits)
    T = _check_temperature(temperature)
    lead, V = logits.shape[:-1], logits.shape[-1]
    targets = _check_ids("target_ids", target_ids, lead, V, logits.device, extra=False)
    ops = _row_ops(logits.device, backend)
    x = _rows(logits, strided=ops.name == "triton")
    lp, ent, _ = LogprobsFunction.apply(x, targets, T, bool(return_entropy), ops)
    lp = lp.view(lead)
    return (lp, ent.view(lead)) if return_entropy else lp


def topk_logprobs(
    logits: torch.Tensor,  # [..., V]
    k: int,
    temperature: float = 1.0,
    *,
    token_ids: torch.Tensor | None = None,  # [..., m]
    backend: Backend | None = None,
) -> TopKLogprobs:
    """The k largest log-probs per row (values, indices) and, given `token_ids`, their log-probs.

    Only `token_logprobs` is differentiable (wrt `logits`); to get gradients for the top-k, pass
    the returned indices (or a support union containing them) as `token_ids`.
    """
    _check_float("logits", logits)
    T = _check_temperature(temperature)
    lead, V = logits.shape[:-1], logits.shape[-1]
    if not 1 <= int(k) <= V:
        raise ValueError(f"k must be in [1, V={V}], got {k}")
    ops = _row_ops(logits.device, backend)
    x = _rows(logits, strided=ops.name == "triton")
    if token_ids is None:
        ids = torch.empty((math.prod(lead), 0), dtype=torch.int64, device=logits.device)
    else:
        ids = _check_ids("token_ids", token_ids, lead, V, logits.device, extra=True)
    lp, _, lse = LogprobsFunction.apply(x, ids, T, False, ops)
    with torch.no_grad():
        values, indices = ops.topk(x.detach(), int(k), T, lse)
    out_lp = lp.view(*lead, ids.shape[1]) if token_ids is not None else None
    return TopKLogprobs(values.view(*lead, int(k)), indices.view(*lead, int(k)), out_lp)


def _check_linear(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int) -> None:
    _check_float("hidden", hidden)
    _check_float("lm_head_weight", weight, min_dim=2)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"lm_head_weight must be [V, H={hidden.shape[-1]}] (the nn.Linear layout), got {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and lm_head_weight ({weight.dtype}) must share a dtype")
    if weight.device != hidden.device:
        raise ValueError(f"hidden is on {hidden.device} but lm_head_weight is on {weight.device}")
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1 tokens, got {chunk_size}")


def _check_head_post(weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None) -> float | None:
    """Validate the optional LM-head bias `[V]` and logit soft-cap; returns the cap as a float."""
    if bias is not None:
        _check_float("lm_head_bias", bias)
        if bias.shape != weight.shape[:1]:
            raise ValueError(f"lm_head_bias must be [V={weight.shape[0]}], got {tuple(bias.shape)}")
        if bias.dtype != weight.dtype or bias.device != weight.device:
            raise ValueError(
                f"lm_head_bias ({bias.dtype}, {bias.device}) must share lm_head_weight's dtype and "
                f"device ({weight.dtype}, {weight.device})"
            )
    if softcap is None:
        return None
    cap = float(softcap)
    if not (math.isfinite(cap) and cap > 0):
        raise ValueError(f"softcap must be a finite number > 0 (or None), got {softcap!r}")
    return cap


def _keep_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, max_bytes: int | None
) -> bool:
    """Whether the forward keeps its `[N, V]` logits for the backward (see KEEP_LOGITS_MAX_BYTES):
    only when a gradient will be asked for and they fit the budget."""
    budget = KEEP_LOGITS_MAX_BYTES if max_bytes is None else int(max_bytes)
    if budget < 0:
        raise ValueError(f"keep_logits_max_bytes must be >= 0 bytes (0 = always recompute), got {max_bytes}")
    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    rows = math.prod(hidden.shape[:-1])
    return wants_grad and rows * weight.shape[0] * weight.element_size() <= budget


def linear_token_logprobs(
    hidden: torch.Tensor,  # [..., H]
    lm_head_weight: torch.Tensor,  # [V, H]
    target_ids: torch.Tensor,  # [...]
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    chunk_size: int = 256,
    backend: Backend | None = None,
    lm_head_bias: torch.Tensor | None = None,  # [V]
    softcap: float | None = None,
    keep_logits_max_bytes: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs(post(hidden @ W.T + b), ...)` computed `chunk_size` tokens at a time.

    Gradients for `hidden`, `lm_head_weight` (and `lm_head_bias`) are correct for any upstream
    gradient (per-token advantages, masks, clipping). The backward needs each chunk's logits
    again: when a gradient is wanted and the `[N, V]` logits take at most
    `keep_logits_max_bytes` (None = `KEEP_LOGITS_MAX_BYTES`, 256 MiB; 0 = never) the forward
    keeps them, else the backward recomputes them chunk by chunk and full logits never exist.
    `softcap`, when given, is `post(x) = softcap * tanh(x / softcap)` per chunk (before the
    temperature), as Gemma-2/3's `final_logit_softcapping`; a linear logit scale folds into
    `temperature`.
    """
    _check_linear(hidden, lm_head_weight, chunk_size)
    cap = _check_head_post(lm_head_weight, lm_head_bias, softcap)
    T = _check_temperature(temperature)
    lead, V = hidden.shape[:-1], lm_head_weight.shape[0]
    targets = _check_ids("target_ids", target_ids, lead, V, hidden.device, extra=False)
    ops = _row_ops(hidden.device, backend)
    lp, ent, *_ = LinearLogprobsFunction.apply(
        _rows(hidden),
        lm_head_weight,
        targets,
        T,
        bool(return_entropy),
        int(chunk_size),
        ops,
        0,
        lm_head_bias,
        cap,
        _keep_logits(hidden, lm_head_weight, lm_head_bias, keep_logits_max_bytes),
    )
    lp = lp.view(lead)
    return (lp, ent.view(lead)) if return_entropy else lp


def linear_topk_logprobs(
    hidden: torch.Tensor,  # [..., H]
    lm_head_weight: torch.Tensor,  # [V, H]
    k: int,
    temperature: float = 1.0,
    *,
    token_ids: torch.Tensor | None = None,  # [..., m]
    chunk_size: int = 256,
    backend: Backend | None = None,
    lm_head_bias: torch.Tensor | None = None,  # [V]
    softcap: float | None = None,
    keep_logits_max_bytes: int | None = None,
) -> TopKLogprobs:
    """`topk_logprobs(post(hidden @ W.T + b), ...)` computed in token chunks; `lm_head_bias`,
    `softcap` and `keep_logits_max_bytes` as in `linear_token_logprobs` (logits are kept only
    when `token_ids` is given: nothing else is differentiable).

    `token_logprobs` is differentiable wrt `hidden`, `lm_head_weight` (and `lm_head_bias`);
    values/indices are not.
    """
    _check_linear(hidden, lm_head_weight, chunk_size)
    cap = _check_head_post(lm_head_weight, lm_head_bias, softcap)
    T = _check_temperature(temperature)
    lead, V = hidden.shape[:-1], lm_head_weight.shape[0]
    if not 1 <= int(k) <= V:
        raise ValueError(f"k must be in [1, V={V}], got {k}")
    h = _rows(hidden)
    if token_ids is None:
        ids = torch.empty((h.shape[0], 0), dtype=torch.int64, device=hidden.device)
    else:
        ids = _check_ids("token_ids", token_ids, lead, V, hidden.device, extra=True)
    ops = _row_ops(hidden.device, backend)
    keep = token_ids is not None and _keep_logits(hidden, lm_head_weight, lm_head_bias, keep_logits_max_bytes)
    lp, _, _, values, indices = LinearLogprobsFunction.apply(
        h, lm_head_weight, ids, T, False, int(chunk_size), ops, int(k), lm_head_bias, cap, keep
    )
    out_lp = lp.view(*lead, ids.shape[1]) if token_ids is not None else None
    return TopKLogprobs(values.view(*lead, int(k)), indices.view(*lead, int(k)), out_lp)
