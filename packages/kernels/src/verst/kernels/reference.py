"""Pure-torch reference implementations (naive, full-vocabulary), used by tests and benchmarks.

They compute in the dtype they are given (pass float64 for a ground truth) and materialise full
`[..., V]` tensors, so they are only for checking and as the naive baseline.
"""

from __future__ import annotations

import torch


def reference_token_logprobs(
    logits: torch.Tensor,  # [..., V]
    target_ids: torch.Tensor,  # [...] (or [..., m])
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    dtype: torch.dtype | None = torch.float64,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(logits / T) gathered at `target_ids` (and the entropy of softmax(logits / T)).

    `target_ids` either has the leading shape of `logits` (one id per row) or one more trailing
    dimension (several ids per row). `dtype=None` keeps the input dtype.
    """
    x = logits.to(dtype) if dtype is not None else logits
    logp = torch.log_softmax(x / temperature, dim=-1)  # [..., V]
    squeeze = target_ids.dim() == logits.dim() - 1
    idx = target_ids.long().unsqueeze(-1) if squeeze else target_ids.long()
    out = logp.gather(-1, idx)
    out = out.squeeze(-1) if squeeze else out
    if not return_entropy:
        return out
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)  # [...]
    return out, entropy


def reference_linear_token_logprobs(
    hidden: torch.Tensor,  # [..., H]
    lm_head_weight: torch.Tensor,  # [V, H]
    target_ids: torch.Tensor,  # [...]
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    dtype: torch.dtype | None = torch.float64,
    lm_head_bias: torch.Tensor | None = None,  # [V]
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The naive `log_softmax(post(hidden @ W.T + b) / T).gather(...)` (full logits materialised),
    `post(x) = softcap * tanh(x / softcap)` when `softcap` is given."""
    h = hidden.to(dtype) if dtype is not None else hidden
    w = lm_head_weight.to(dtype) if dtype is not None else lm_head_weight
    logits = h @ w.T
    if lm_head_bias is not None:
        logits = logits + (lm_head_bias.to(dtype) if dtype is not None else lm_head_bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return reference_token_logprobs(logits, target_ids, temperature, return_entropy, dtype=None)


def reference_topk_logprobs(
    logits: torch.Tensor,  # [..., V]
    k: int,
    temperature: float = 1.0,
    *,
    dtype: torch.dtype | None = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [..., k], indices [..., k]) of the k largest log-probs per row, descending."""
    x = logits.to(dtype) if dtype is not None else logits
    logp = torch.log_softmax(x / temperature, dim=-1)
    return torch.topk(logp, k, dim=-1)


def reference_full_logprobs(
    logits: torch.Tensor, temperature: float = 1.0, *, dtype: torch.dtype | None = torch.float64
) -> torch.Tensor:
    """All log-probs `[..., V]` (for checking top-k indices against values)."""
    x = logits.to(dtype) if dtype is not None else logits
    return torch.log_softmax(x / temperature, dim=-1)
