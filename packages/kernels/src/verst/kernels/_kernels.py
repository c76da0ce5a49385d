"""Private Triton kernels. Call them only through `_launchers` (which checks their inputs).

One program handles one row (or one (row, vocab block) pair for the top-k candidates). Logits are
read in blocks of `BLOCK_V` with a streaming (online) log-sum-exp, so any vocabulary size works,
including sizes that are not a multiple of the block. All arithmetic is float32.

Rows are addressed through two strides, `(row // rows_per_b) * stride_b + (row % rows_per_b) *
stride_t`, so a `[B, T, V]` view such as `logits[:, :-1]` of a `[B, T+1, V]` tensor is read in
place (2-D inputs use `stride_b = 0`, `rows_per_b = N`).

The backward adds each target's gradient with a scalar loop over the row's targets that touches
the block only when the target falls in it: no `[BLOCK_V, BLOCK_M]` comparison tile (which, for
the OPD token-id path with 16 targets per row and 4096-wide blocks, needed far more registers
than a program has and spilled when compiled for sm_90).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row_forward_kernel(
    logits_ptr,  # [N, V] rows (see the module docstring for the addressing), unit column stride
    stride_b,
    stride_t,
    rows_per_b,
    targets_ptr,  # [N, M] int64, contiguous
    logprobs_ptr,  # [N, M] float32, contiguous
    entropy_ptr,  # [N] float32 (unused unless WITH_ENTROPY)
    lse_ptr,  # [N] float32
    V,
    M,
    temperature,
    BLOCK_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + (row // rows_per_b) * stride_b + (row % rows_per_b) * stride_t
    offs = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), tl.float32)  # running max of x = logits / T
    s = tl.zeros((), tl.float32)  # sum exp(x - m)
    t = tl.zeros((), tl.float32)  # sum exp(x - m) * (x - m)   (entropy only)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) / temperature
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: avoid inf - inf
        alpha = tl.exp(m - m_ref)
        e = tl.exp(x - m_ref)
        if WITH_ENTROPY:
            d = tl.where(e > 0, x - m_ref, 0.0)
            t_old = alpha * (t + s * tl.where(s > 0, m - m_ref, 0.0))  # s == 0: m is -inf
            t = t_old + tl.sum(e * d, axis=0)
        s = s * alpha + tl.sum(e, axis=0)
        m = m_new
    lse = m + tl.log(s)
    tl.store(lse_ptr + row, lse)
    if WITH_ENTROPY:
        # H = lse - E[x] = log s - t / s: both terms >= 0, no cancellation for large logits.
        tl.store(entropy_ptr + row, tl.log(s) - t / s)
    offs_m = tl.arange(0, BLOCK_M)
    for mstart in range(0, M, BLOCK_M):
        cm = mstart + offs_m
        mmask = cm < M
        tgt = tl.load(targets_ptr + row * M + cm, mask=mmask, other=0)
        xt = tl.load(base + tgt, mask=mmask, other=0.0).to(tl.float32) / temperature
        tl.store(logprobs_ptr + row * M + cm, xt - lse, mask=mmask)


@triton.jit
def _row_backward_kernel(
    logits_ptr,  # [N, V] rows (strided addressing), unit column stride
    stride_b,
    stride_t,
    rows_per_b,
    targets_ptr,  # [N, M] int64, contiguous
    lse_ptr,  # [N] float32
    entropy_ptr,  # [N] float32 (unused unless WITH_ENTROPY)
    grad_lp_ptr,  # [N, M] float32, contiguous
    grad_ent_ptr,  # [N] float32 (unused unless WITH_ENTROPY)
    grad_ptr,  # [N, V] output (its own dtype), contiguous
    V,
    M,
    temperature,
    BLOCK_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + (row // rows_per_b) * stride_b + (row % rows_per_b) * stride_t
    lse = tl.load(lse_ptr + row)
    offs_m = tl.arange(0, BLOCK_M)
    gsum = tl.zeros((), tl.float32)
    for mstart in range(0, M, BLOCK_M):
        cm = mstart + offs_m
        gsum += tl.sum(tl.load(grad_lp_ptr + row * M + cm, mask=cm < M, other=0.0), axis=0)
    if WITH_ENTROPY:
        ent = tl.load(entropy_ptr + row)
        g_ent = tl.load(grad_ent_ptr + row)
    offs = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        vmask = cols < V
        x = tl.load(base + cols, mask=vmask, other=float("-inf")).to(tl.float32) / temperature
        logp = x - lse
        p = tl.exp(logp)
        g = -p * gsum
        if WITH_ENTROPY:
            g -= g_ent * p * (tl.where(p > 0, logp, 0.0) + ent)  # p == 0: logp may be -inf
        for j in range(0, M):  # scalar per target; only a hit touches the block
            tgt = tl.load(targets_ptr + row * M + j)
            if (tgt >= start) & (tgt < start + BLOCK_V):
                g += tl.where(cols == tgt, tl.load(grad_lp_ptr + row * M + j), 0.0)
        g = g / temperature
        tl.store(grad_ptr + row * V + cols, g.to(grad_ptr.dtype.element_ty), mask=vmask)


@triton.jit
def _block_topk_kernel(
    logits_ptr,  # [N, V] rows (strided addressing), unit column stride
    stride_b,
    stride_t,
    rows_per_b,
    lse_ptr,  # [N] float32
    cand_val_ptr,  # [N, n_blocks, K] float32
    cand_idx_ptr,  # [N, n_blocks, K] int64 (>= V marks "no candidate")
    V,
    n_blocks,
    temperature,
    K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Top-K of one vocabulary block by K rounds of masked max (ties: lowest index first)."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    offs = tl.arange(0, BLOCK_V)
    cols = blk * BLOCK_V + offs
    avail = cols < V
    base = logits_ptr + (row // rows_per_b) * stride_b + (row % rows_per_b) * stride_t
    x = tl.load(base + cols, mask=avail, other=float("-inf")).to(tl.float32)
    x = x / temperature
    lse = tl.load(lse_ptr + row)
    out = (row * n_blocks + blk) * K
    for i in range(K):
        key = tl.where(avail, x, float("-inf"))
        best = tl.max(key, axis=0)
        pos = tl.min(tl.where(avail & (key == best), offs, BLOCK_V), axis=0)  # BLOCK_V: none left
        tl.store(cand_val_ptr + out + i, best - lse)
        tl.store(cand_idx_ptr + out + i, (blk * BLOCK_V + pos).to(tl.int64) + tl.where(pos < BLOCK_V, 0, V))
        avail = avail & (offs != pos)
