"""Launchers for the Triton kernels: check shapes, strides, dtypes and devices, then launch.

Each launcher takes row batches — logits `[N, V]`, or `[B, T, V]` (e.g. `x[:, :-1]` of a
`[B, T+1, V]` tensor, read in place through its strides instead of copied), unit stride along
the vocabulary — and raises a ValueError that says what is wrong and how to fix it before any
kernel runs. Gradients come back contiguous in the logits' shape.
"""

from __future__ import annotations

import contextlib

import torch
import triton

from verst.kernels._kernels import _block_topk_kernel, _row_backward_kernel, _row_forward_kernel

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_BLOCK_V = 4096
MAX_BLOCK_M = 16


def _check_logits(logits: torch.Tensor, where: str) -> None:
    if logits.dim() not in (2, 3):
        raise ValueError(
            f"{where}: logits must be [N, V] or [B, T, V], got shape {tuple(logits.shape)}; reshape(-1, V)"
        )
    if logits.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"{where}: logits dtype {logits.dtype} is not supported; valid: float32, bfloat16, float16"
        )
    if logits.shape[-1] > 0 and logits.stride(-1) != 1:
        raise ValueError(
            f"{where}: logits must have unit stride along the vocabulary (got strides {logits.stride()}); "
            "call .contiguous() first"
        )


def _layout(logits: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(N rows, V, stride_b, stride_t, rows_per_b) of a `[N, V]` or `[B, T, V]` logits view."""
    V = logits.shape[-1]
    if logits.dim() == 2:
        N = logits.shape[0]
        return N, V, 0, logits.stride(0), max(N, 1)
    B, T = logits.shape[0], logits.shape[1]
    return B * T, V, logits.stride(0), logits.stride(1), max(T, 1)


def _check_rows(
    name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, ref: torch.Tensor, where: str
) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{where}: {name} must have shape {shape}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{where}: {name} must be {dtype}, got {t.dtype}; convert with .to({dtype})")
    if t.device != ref.device:
        raise ValueError(
            f"{where}: {name} is on {t.device} but logits are on {ref.device}; move them together"
        )
    if not t.is_contiguous():
        raise ValueError(f"{where}: {name} must be contiguous; call .contiguous() first")


def _block_v(V: int, block_v: int | None) -> int:
    if block_v is None:
        return min(triton.next_power_of_2(max(V, 1)), DEFAULT_BLOCK_V)
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a positive power of two, got {block_v}")
    return block_v


def _block_m(M: int) -> int:
    return min(triton.next_power_of_2(max(M, 1)), MAX_BLOCK_M)


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """Launch on the tensors' GPU (Triton launches on the current CUDA device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _num_warps(block: int) -> int:
    return 8 if block >= 2048 else 4


class TritonRowOps:
    """Row-wise log-prob forward/backward and top-k with Triton kernels (same contract as TorchRowOps)."""

    name = "triton"
    uses_workspace = False  # the kernels need no temporaries; `workspace=` is accepted and ignored

    @staticmethod
    def forward(
        logits: torch.Tensor,  # [N, V]
        targets: torch.Tensor,  # [N, M] int64
        temperature: float,
        with_entropy: bool,
        *,
        overwrite: bool = False,
        workspace: torch.Tensor | None = None,
        block_v: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Returns (log-probs [N, M], entropy [N] or None, log-sum-exp of logits/T [N]), float32.

        `overwrite` and `workspace` are accepted for the RowOps contract; the kernel needs no
        temporaries and never writes the logits."""
        where = "token log-probs (triton forward)"
        _check_logits(logits, where)
        N, V, sb, st, rpb = _layout(logits)
        if targets.dim() != 2 or targets.shape[0] != N:
            raise ValueError(f"{where}: targets must be [N={N}, M], got {tuple(targets.shape)}")
        _check_rows("targets", targets, (N, targets.shape[1]), torch.int64, logits, where)
        M = targets.shape[1]
        dev = logits.device
        logprobs = torch.empty((N, M), dtype=torch.float32, device=dev)
        lse = torch.empty((N,), dtype=torch.float32, device=dev)
        entropy = torch.empty((N,), dtype=torch.float32, device=dev) if with_entropy else lse
        if N > 0:
            bv = _block_v(V, block_v)
            with _on(dev):
                _row_forward_kernel[(N,)](
                    logits, sb, st, rpb, targets, logprobs, entropy, lse, V, M, float(temperature),
                    BLOCK_V=bv, BLOCK_M=_block_m(M), WITH_ENTROPY=with_entropy, num_warps=_num_warps(bv),
                )  # fmt: skip
        return logprobs, (entropy if with_entropy else None), lse

    @staticmethod
    def backward(
        logits: torch.Tensor,  # [N, V]
        targets: torch.Tensor,  # [N, M]
        temperature: float,
        lse: torch.Tensor,  # [N]
        entropy: torch.Tensor | None,  # [N]
        grad_logprobs: torch.Tensor,  # [N, M] float32
        grad_entropy: torch.Tensor | None,  # [N] float32
        out_dtype: torch.dtype,
        *,
        overwrite: bool = False,
        workspace: torch.Tensor | None = None,
        block_v: int | None = None,
    ) -> torch.Tensor:
        """Gradient wrt logits (contiguous, the logits' shape) in `out_dtype` (float32 accumulation)."""
        where = "token log-probs (triton backward)"
        _check_logits(logits, where)
        N, V, sb, st, rpb = _layout(logits)
        if targets.dim() != 2:
            raise ValueError(f"{where}: targets must be [N={N}, M], got {tuple(targets.shape)}")
        M = targets.shape[1]
        _check_rows("targets", targets, (N, M), torch.int64, logits, where)
        _check_rows("lse", lse, (N,), torch.float32, logits, where)
        grad_logprobs = grad_logprobs.to(torch.float32).contiguous()
        _check_rows("grad_logprobs", grad_logprobs, (N, M), torch.float32, logits, where)
        with_entropy = grad_entropy is not None and entropy is not None
        if with_entropy:
            grad_entropy = grad_entropy.to(torch.float32).contiguous()
            _check_rows("entropy", entropy, (N,), torch.float32, logits, where)
            _check_rows("grad_entropy", grad_entropy, (N,), torch.float32, logits, where)
        if out_dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"{where}: out_dtype {out_dtype} not supported; valid: float32, bfloat16, float16"
            )
        grad = torch.empty(logits.shape, dtype=out_dtype, device=logits.device)
        if N > 0:
            bv = _block_v(V, block_v)
            with _on(logits.device):
                _row_backward_kernel[(N,)](
                    logits, sb, st, rpb, targets, lse,
                    entropy if with_entropy else lse, grad_logprobs,
                    grad_entropy if with_entropy else lse, grad, V, M, float(temperature),
                    BLOCK_V=bv, BLOCK_M=_block_m(M), WITH_ENTROPY=with_entropy, num_warps=_num_warps(bv),
                )  # fmt: skip
        return grad

    @staticmethod
    def topk(
        logits: torch.Tensor,  # [N, V]
        k: int,
        temperature: float,
        lse: torch.Tensor,  # [N]
        *,
        block_v: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [N, k] float32 descending, indices [N, k] int64); ties: lowest index first.

        Each (row, vocab block) program writes its block's top-k; the N x (blocks*k) candidates
        are merged here with a stable sort (small: e.g. 38 blocks x k=20 = 760 per row).
        """
        where = "top-k log-probs (triton)"
        _check_logits(logits, where)
        N, V, sb, st, rpb = _layout(logits)
        if not 1 <= k <= V:
            raise ValueError(f"{where}: k must be in [1, V={V}], got {k}")
        _check_rows("lse", lse, (N,), torch.float32, logits, where)
        dev = logits.device
        if N == 0:
            return torch.empty((0, k), dtype=torch.float32, device=dev), torch.empty(
                (0, k), dtype=torch.int64, device=dev
            )
        bv = _block_v(V, block_v)
        n_blocks = triton.cdiv(V, bv)
        kk = min(k, bv)
        cand_val = torch.empty((N, n_blocks, kk), dtype=torch.float32, device=dev)
        cand_idx = torch.empty((N, n_blocks, kk), dtype=torch.int64, device=dev)
        with _on(dev):
            _block_topk_kernel[(N, n_blocks)](
                logits, sb, st, rpb, lse, cand_val, cand_idx, V, n_blocks, float(temperature),
                K=kk, BLOCK_V=bv, num_warps=_num_warps(bv),
            )  # fmt: skip
        cand_val = cand_val.view(N, -1)
        cand_idx = cand_idx.view(N, -1)
        valid = cand_idx < V
        order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)  # valid candidates first
        cand_val = cand_val.gather(-1, order)
        cand_idx = cand_idx.gather(-1, order)
        vals, pos = torch.sort(cand_val, dim=-1, descending=True, stable=True)
        return vals[:, :k].contiguous(), cand_idx.gather(-1, pos[:, :k])
