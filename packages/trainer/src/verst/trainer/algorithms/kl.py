"""Per-token KL estimators between the policy and a frozen reference.

Each is a function of the per-token log-ratio ``d = logp − logp_ref`` (Schulman's "Approximating
KL divergence", http://joschu.net/blog/kl-approx.html), estimating ``KL(π ‖ π_ref)`` from tokens
sampled from π:

- ``k1``: ``d`` (unbiased, high variance, can be negative).
- ``k2``: ``½ d²`` (biased, low variance, ≥ 0).
- ``k3``: ``exp(−d) + d − 1`` (unbiased, low variance, ≥ 0).
- ``low_var``: ``k3`` computed with ``−d`` clamped to [−20, 20] and the result clamped to
  [−10, 10] — verl's ``low_var_kl`` (stable when the policy drifts far from the reference).

As a loss term (`use_kl_loss`) the gradient flows through ``logp``; as reward shaping
(`use_kl_in_reward`) the estimator is applied to ``logp_old − logp_ref`` (no gradient).

A new estimator is a function ``(log_ratio [B, T]) -> [B, T]`` plus one entry in `KL_ESTIMATORS`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def k1(log_ratio: Tensor) -> Tensor:
    """``d``. log_ratio: [B, T] = logp − logp_ref."""
    return log_ratio


def k2(log_ratio: Tensor) -> Tensor:
    """``½ d²``. log_ratio: [B, T]."""
    return 0.5 * log_ratio.square()


def k3(log_ratio: Tensor) -> Tensor:
    """``exp(−d) + d − 1``, as ``expm1(−d) + d`` (accurate, ≥ 0 near d = 0). log_ratio: [B, T]."""
    return torch.expm1(-log_ratio) + log_ratio


def low_var(log_ratio: Tensor) -> Tensor:
    """``k3`` with ``−d`` clamped to [−20, 20] and the result to [−10, 10] (verl's low_var_kl)."""
    neg = (-log_ratio).clamp(-20.0, 20.0)
    return (torch.expm1(neg) - neg).clamp(-10.0, 10.0)


KlEstimator = Callable[[Tensor], Tensor]

KL_ESTIMATORS: dict[str, KlEstimator] = {"k1": k1, "k2": k2, "k3": k3, "low_var": low_var}
"""KL estimators by config name (`AlgorithmConfig.kl_estimator`)."""
