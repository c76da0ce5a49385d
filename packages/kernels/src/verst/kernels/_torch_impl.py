"""Torch implementation of the row operations (CPU, and the fallback on GPU without Triton).

Every function works on 2-D row batches: logits `[N, V]` (float32/bfloat16/float16), target ids
`[N, M]` int64; all arithmetic is float32. Temporaries are a few `[N, V]` float32 arrays, so
callers that care about memory (the chunked linear path) pass small row chunks.
"""

from __future__ import annotations

import torch


def scaled_float32(
    logits: torch.Tensor, temperature: float, overwrite: bool, workspace: torch.Tensor | None
) -> torch.Tensor:
    """logits / T in float32 that may be modified in place: `logits` itself when the caller
    allows overwriting it (and it is float32), else written into `workspace` (a float32 buffer
    with at least the logits' rows) or a fresh copy. Every form computes `float32(x) / T`."""
    if overwrite and logits.dtype == torch.float32:
        return logits.div_(temperature) if temperature != 1.0 else logits
    if workspace is None:
        x = logits.to(torch.float32, copy=True)
        return x.div_(temperature) if temperature != 1.0 else x
    x = workspace[: logits.shape[0]]
    if temperature != 1.0 and logits.dtype == torch.float32:
        return torch.div(logits, temperature, out=x)  # one pass: read logits, write x
    x.copy_(logits)
    return x.div_(temperature) if temperature != 1.0 else x


_MOMENT_ROWS = 16
"""Rows per step of `_exp_moments` on CPU: a `[16, V]` float32 buffer stays in cache."""


def _exp_moments(xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(Σ_v e^xs, Σ_v e^xs · xs)` per row of `xs = x - max` `[N, V]` (may hold -inf), float32.

    On CPU a few rows at a time through one reused buffer with a fused dot product (no `[N, V]`
    temporary; ~2x faster than exp + mul + nan_to_num + sum over the whole chunk); a row whose
    dot product is NaN (0 * -inf: a masked logit) is redone with 0 * -inf = 0. On GPU the
    whole-chunk form (one kernel each)."""
    if xs.device.type != "cpu":
        p = xs.exp()  # [N, V] unnormalised
        return p.sum(-1), p.mul_(xs).nan_to_num_(nan=0.0).sum(-1)  # 0 * -inf -> 0
    n, v = xs.shape
    s = torch.empty(n, dtype=torch.float32)
    t = torch.empty(n, dtype=torch.float32)
    buf = torch.empty((min(n, _MOMENT_ROWS), v), dtype=torch.float32)  # [rows, V]
    for i in range(0, n, _MOMENT_ROWS):
        j = min(i + _MOMENT_ROWS, n)
        p = torch.exp(xs[i:j], out=buf[: j - i])
        s[i:j] = p.sum(-1)
        t[i:j] = torch.linalg.vecdot(p, xs[i:j])
    bad = t.isnan()
    if bool(bad.any()):
        rows = xs[bad]
        t[bad] = rows.exp().mul_(rows).nan_to_num_(nan=0.0).sum(-1)
    return s, t


def finite_shift(m: torch.Tensor) -> torch.Tensor:
    """The shift `exp_moments` used for a row max `m`: `m`, or 0 where the row is all -inf."""
    return torch.where(m == float("-inf"), torch.zeros_like(m), m)


def exp_moments(
    x: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(row max `m` [N] (-inf for an all -inf row), `s = Σ e`, `t = Σ e (x - c)` or None) of the
    float32 `x` `[N, V]`, which is overwritten, with `e = exp(x - c)` and `c = finite_shift(m)`."""
    m = x.amax(dim=-1)  # [N]
    xs = x.sub_(finite_shift(m)[:, None])  # x - c, in place
    if with_entropy:
        s, t = _exp_moments(xs)
        return m, s, t
    return m, xs.exp_().sum(-1), None


def logits_grad(
    logits: torch.Tensor,  # [N, W] (a tile of the vocabulary, or all of it)
    targets: torch.Tensor,  # [N, M] int64, column indices into `logits`
    grad_targets: torch.Tensor,  # [N, M] float32, added at `targets` (0 for a target elsewhere)
    grad_sum: torch.Tensor,  # [N, 1] float32, the row's whole upstream log-prob gradient
    temperature: float,
    lse: torch.Tensor,  # [N]
    entropy: torch.Tensor | None,  # [N]
    grad_entropy: torch.Tensor | None,  # [N] float32
    *,
    overwrite: bool,
    workspace: torch.Tensor | None,
) -> torch.Tensor:
    """Float32 gradient wrt `logits` (`overwrite`, `workspace` as in `TorchRowOps.forward`): every
    term but the target columns' is elementwise given the row's `lse` (and entropy), so a tile of
    the vocabulary gets its part of the row's gradient.

    d lp_m / d x_j = [j == t_m] - p_j and d H / d x_j = -p_j (log p_j + H), with x = logits / T.
    """
    logp = scaled_float32(logits, temperature, overwrite, workspace).sub_(lse[:, None])  # [N, W]
    if grad_entropy is None or entropy is None:  # one [N, W] buffer: p computed in place
        grad = logp.exp_().mul_(-grad_sum)
    else:
        p = logp.exp()  # [N, W]
        term = logp.add_(entropy[:, None]).mul_(p).nan_to_num_(nan=0.0)  # p (log p + H)
        grad = p.mul_(-grad_sum)
        grad.addcmul_(term, grad_entropy[:, None], value=-1.0)
    grad.scatter_add_(-1, targets, grad_targets)
    if temperature != 1.0:
        grad.div_(temperature)
    return grad


class TorchRowOps:
    """Row-wise log-prob forward/backward and top-k written with torch ops."""

    name = "torch"
    uses_workspace = True

    @staticmethod
    def forward(
        logits: torch.Tensor,  # [N, V]
        targets: torch.Tensor,  # [N, M] int64
        temperature: float,
        with_entropy: bool,
        *,
        overwrite: bool = False,
        workspace: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Returns (log-probs [N, M], entropy [N] or None, log-sum-exp of logits/T [N]), float32.

        `overwrite=True`: `logits` is the caller's temporary and may be clobbered (saves one
        `[N, V]` float32 array; the chunked linear path uses it). `workspace`: a float32
        `[>= N, V]` buffer used instead of allocating that array when `logits` must be kept."""
        x = scaled_float32(logits, temperature, overwrite, workspace)  # [N, V]
        picked = x.gather(-1, targets)  # [N, M], before x is modified
        m, s, t = exp_moments(x, with_entropy)
        # H = log s - sum p (x - m) / s: two non-negative terms, no cancellation
        entropy = s.log() - t / s if t is not None else None
        lse = finite_shift(m) + s.log()  # [N]
        logprobs = picked - lse[:, None]
        return logprobs, entropy, lse

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
    ) -> torch.Tensor:
        """Gradient wrt logits `[N, V]` in `out_dtype` (`overwrite`, `workspace` as in `forward`;
        the float32 gradient may be the logits' or the workspace's storage).

        d lp_m / d x_j = [j == t_m] - p_j and d H / d x_j = -p_j (log p_j + H), with x = logits / T.
        """
        grad_logprobs = grad_logprobs.to(torch.float32)
        grad = logits_grad(
            logits, targets, grad_logprobs, grad_logprobs.sum(-1, keepdim=True), temperature, lse,
            entropy, grad_entropy, overwrite=overwrite, workspace=workspace,
        )  # fmt: skip
        return grad.to(out_dtype)

    @staticmethod
    def topk(
        logits: torch.Tensor,  # [N, V]
        k: int,
        temperature: float,
        lse: torch.Tensor,  # [N]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [N, k] float32 descending, indices [N, k] int64)."""
        raw, idx = torch.topk(logits, k, dim=-1)  # order of logits/T equals order of logits (T > 0)
        return raw.to(torch.float32) / temperature - lse[:, None], idx
