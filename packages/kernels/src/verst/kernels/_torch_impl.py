"""Torch implementation of the row operations (CPU, and the fallback on GPU without Triton).

Every function works on 2-D row batches: logits `[N, V]` (float32/bfloat16/float16), target ids
`[N, M]` int64; all arithmetic is float32. Temporaries are a few `[N, V]` float32 arrays, so
callers that care about memory (the chunked linear path) pass small row chunks.
"""

from __future__ import annotations

import torch


def _scaled_float32(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """A fresh float32 copy of logits / T (fresh so it can be modified in place)."""
    x = logits.to(torch.float32, copy=True)  # [N, V]
    if temperature != 1.0:
        x.div_(temperature)
    return x


class TorchRowOps:
    """Row-wise log-prob forward/backward and top-k written with torch ops."""

    name = "torch"

    @staticmethod
    def forward(
        logits: torch.Tensor,  # [N, V]
        targets: torch.Tensor,  # [N, M] int64
        temperature: float,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Returns (log-probs [N, M], entropy [N] or None, log-sum-exp of logits/T [N]), float32."""
        x = _scaled_float32(logits, temperature)  # [N, V]
        lse = torch.logsumexp(x, dim=-1)  # [N]
        logprobs = x.gather(-1, targets) - lse[:, None]  # [N, M]
        entropy = None
        if with_entropy:
            logp = x.sub_(lse[:, None])  # [N, V]
            p = logp.exp()
            plogp = p.mul_(logp).nan_to_num_(nan=0.0)  # 0 * -inf -> 0
            entropy = -plogp.sum(-1)  # [N]
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
    ) -> torch.Tensor:
        """Gradient wrt logits `[N, V]` in `out_dtype`.

        d lp_m / d x_j = [j == t_m] - p_j and d H / d x_j = -p_j (log p_j + H), with x = logits / T.
        """
        logp = _scaled_float32(logits, temperature).sub_(lse[:, None])  # [N, V]
        p = logp.exp()  # [N, V]
        if grad_entropy is not None and entropy is not None:
            term = logp.add_(entropy[:, None]).mul_(p).nan_to_num_(nan=0.0)  # p (log p + H)
            grad = p.mul_(-grad_logprobs.sum(-1, keepdim=True))
            grad.addcmul_(term, grad_entropy[:, None], value=-1.0)
        else:
            grad = p.mul_(-grad_logprobs.sum(-1, keepdim=True))
        grad.scatter_add_(-1, targets, grad_logprobs.to(torch.float32))
        if temperature != 1.0:
            grad.div_(temperature)
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
