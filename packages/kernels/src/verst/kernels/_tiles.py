"""The torch backend's chunked linear path in vocabulary tiles (`LinearLogprobsFunction`).

A tile is `rows` tokens by `cols` vocabulary entries, as many elements as a `[chunk_size, V]`
token chunk (`tile_shape`): up to `TILE_CHUNKS * chunk_size` tokens (all of them when there are
fewer) by the matching slice of the vocabulary. The forward merges each tile's row max, `Σ e`
and `Σ e (x - c)` into the row's log-sum-exp and entropy (online, as one pass over the row
would), gathers the targets that fall in the tile and merges its top-k candidates. The backward
recomputes the same tiles (the same matmul, so bit-identical logits), turns each into its part
of the gradient wrt the logits (elementwise given the forward's `lse`) and does
`grad_h[rows] += g @ W[cols]` and `grad_W[cols] = g.T @ h[rows]`.

Why tiles: with token chunks the backward adds every chunk's `g.T @ h` into the whole float32
`[V, H]` `grad_W` (N / chunk read-modify-write passes over it, 16 at 4,096 tokens: ~16 GiB of
memory traffic at V = 151,936, H = 896) and streams all of `W` through three matmuls per chunk;
with a tile spanning all the tokens `grad_W` is written once and `W` read about once per pass.
The LM-head matmul count is the same (forward, recompute, `grad_h`, `grad_W`). See
docs/kernels.md.
"""

from __future__ import annotations

import torch

from verst.kernels._logits import TileLogits
from verst.kernels._torch_impl import TorchRowOps, exp_moments, finite_shift, logits_grad, scaled_float32

TILE_CHUNKS = 16
"""A tile spans up to this many `chunk_size` token chunks (4,096 tokens at the default 256)."""

Moments = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""(row max (-inf for none yet), `s = Σ exp(x - c)`, `t = Σ exp(x - c) (x - c)` | None), `c = finite_shift(max)`."""


def tile_shape(n: int, v: int, chunk_size: int) -> tuple[int, int]:
    """(rows, cols) of a tile of `n` tokens' `[n, v]` logits: at most `chunk_size * v` elements."""
    rows = max(1, min(n, TILE_CHUNKS * chunk_size, chunk_size * v))
    return rows, max(1, min(v, chunk_size * v // rows))


def _merge(a: Moments, b: Moments) -> Moments:
    """The moments of two column ranges of the same rows, relative to their joint shift."""
    (ma, sa, ta), (mb, sb, tb) = a, b
    m = torch.maximum(ma, mb)
    c, ca, cb = finite_shift(m), finite_shift(ma), finite_shift(mb)
    wa, wb = (ma - c).exp_(), (mb - c).exp_()  # 0 for a side with no finite logit yet
    t = None  # Σ e (x - c) = w (t' + s' (c' - c)): both terms <= 0, no cancellation
    if ta is not None and tb is not None:
        t = wa * (ta + sa * (ca - c)) + wb * (tb + sb * (cb - c))
    return m, wa * sa + wb * sb, t


def _pick(x: torch.Tensor, targets: torch.Tensor, v0: int, picked: torch.Tensor | None) -> torch.Tensor:
    """`picked` with the targets in columns `[v0, v0 + cols)` of the row block read from `x`."""
    local = targets - v0  # [rows, M]
    inside = (local >= 0) & (local < x.shape[1])
    vals = x.gather(-1, local.clamp_(0, x.shape[1] - 1))
    return vals if picked is None else torch.where(inside, vals, picked)


def _topk(logits: torch.Tensor, k: int, v0: int, best: tuple[torch.Tensor, torch.Tensor] | None):
    """The k largest logits (float32) and their vocabulary ids among `best` and this tile's."""
    vals, idx = torch.topk(logits, min(k, logits.shape[1]), dim=-1)
    vals, idx = vals.to(torch.float32), idx + v0
    if best is not None:
        vals, idx = torch.cat([best[0], vals], -1), torch.cat([best[1], idx], -1)
        vals, j = torch.topk(vals, min(k, vals.shape[1]), dim=-1)
        idx = idx.gather(-1, j)
    return vals, idx


def tiled_forward(
    chunks: TileLogits,
    targets: torch.Tensor,  # [N, M]
    temperature: float,
    shape: tuple[int, int],
    keep: bool,
    out: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
) -> None:
    """Fill `out` = (log-probs [N, M], entropy [N] | None, lse [N], top-k values | None, top-k
    ids | None) tile by tile; `keep` writes every tile's logits into `chunks.kept`."""
    logprobs, entropy, lse, top_v, top_i = out
    (N, V), (rows, cols) = (targets.shape[0], chunks.weight.shape[0]), shape
    for s in range(0, N, rows):
        e = min(s + rows, N)
        picked, acc, best = None, None, None
        for v0 in range(0, V, cols):
            logits, _, own = chunks.compute(s, e, v0, min(v0 + cols, V), keep=keep)
            if top_v is not None:  # before the row ops overwrite the logits
                best = _topk(logits, top_v.shape[1], v0, best)
            x = scaled_float32(logits, temperature, own, chunks.workspace(TorchRowOps, logits, own))
            picked = _pick(x, targets[s:e], v0, picked)
            tile = exp_moments(x, entropy is not None)
            acc = tile if acc is None else _merge(acc, tile)
            del logits, x
        assert picked is not None and acc is not None
        m, ssum, t = acc
        lse[s:e] = finite_shift(m) + ssum.log()
        logprobs[s:e] = picked - lse[s:e, None]
        if entropy is not None and t is not None:  # log s - t / s: two non-negative terms
            entropy[s:e] = ssum.log() - t / ssum
        if top_v is not None and top_i is not None and best is not None:
            top_v[s:e], top_i[s:e] = best[0] / temperature - lse[s:e, None], best[1]


def _tile_grad(
    chunks: TileLogits, s: int, e: int, v0: int, v1: int, saved: tuple, temperature: float
) -> torch.Tensor:
    """Float32 gradient wrt the tile's logits (pre-soft-cap), `[e - s, v1 - v0]`."""
    targets, lse, entropy, grad_lp, grad_sum, grad_ent = saved
    logits, t, own = chunks.compute(s, e, v0, v1, keep=False)
    local = targets[s:e] - v0
    inside = (local >= 0) & (local < v1 - v0)
    grad = logits_grad(
        logits, local.clamp_(0, v1 - v0 - 1), torch.where(inside, grad_lp[s:e], 0.0), grad_sum[s:e],
        temperature, lse[s:e], entropy[s:e] if entropy is not None else None,
        grad_ent[s:e] if grad_ent is not None else None,
        overwrite=own, workspace=chunks.workspace(TorchRowOps, logits, own),
    )  # fmt: skip  # may reuse the logits' or the workspace's buffer
    del logits
    if t is not None:  # d cap*tanh(x/cap) / dx = 1 - tanh(x/cap)^2
        grad.mul_(t.square_().neg_().add_(1.0))
    return grad


def tiled_backward(
    chunks: TileLogits,
    saved: tuple,  # (targets [N, M], lse [N], entropy | None, grad_lp [N, M], grad_sum [N, 1], grad_ent | None)
    temperature: float,
    shape: tuple[int, int],
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None],
) -> None:
    """Write `grads` = (grad_h [N, H] the input dtype, grad_W [V, H] float32 (written, not added
    to), grad_b [V] float32 zeros) | None each, tile by tile."""
    grad_h, grad_w, grad_b = grads
    hidden, weight = chunks.hidden, chunks.weight
    low = hidden.dtype != torch.float32  # then both grad matmuls run in float32
    (N, V), (rows, cols) = (hidden.shape[0], weight.shape[0]), shape
    if grad_w is not None and N == 0:  # no token block writes it
        grad_w.zero_()
    for s in range(0, N, rows):
        e = min(s + rows, N)
        h = hidden[s:e].float() if low and grad_w is not None else hidden[s:e]  # [rows, H]
        gh = grad_h[s:e] if grad_h is not None and not low else None
        if grad_h is not None and low:
            gh = torch.empty((e - s, hidden.shape[1]), dtype=torch.float32, device=hidden.device)
        for v0 in range(0, V, cols):
            v1 = min(v0 + cols, V)
            g = _tile_grad(chunks, s, e, v0, v1, saved, temperature)  # [rows, cols] float32
            if grad_b is not None:
                grad_b[v0:v1] += g.sum(0)
            if gh is not None:
                w = weight[v0:v1].float() if low else weight[v0:v1]
                gh.addmm_(g, w) if v0 else torch.mm(g, w, out=gh)
            if grad_w is not None:
                grad_w[v0:v1].addmm_(g.T, h) if s else torch.mm(g.T, h, out=grad_w[v0:v1])
            del g
        if grad_h is not None and gh is not None and low:
            grad_h[s:e] = gh
