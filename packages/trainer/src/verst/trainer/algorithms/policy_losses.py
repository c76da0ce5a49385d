"""Per-token policy-gradient losses (before aggregation, TIS weighting, KL and entropy terms).

- ``ppo`` (`PpoClip`): ``ρ_t = exp(logp_t − logp_old_t)``,
  ``l_t = max(−A_t ρ_t, −A_t clip(ρ_t, 1 − ε_low, 1 + ε_high))`` (PPO; clip-higher from DAPO:
  ``ε_high > ε_low``). Dual-clip (Ye et al., 2020) with ``c > 1``: for ``A_t < 0``,
  ``l_t = min(l_t, −A_t · c) = min(l_t, c·|A_t|)``. The log-ratio is clamped to [−20, 20] before
  ``exp`` for stability.
- ``gspo`` (`Gspo`): sequence-level ratio ``s_i = exp(Σ_t m_it (logp_it − logp_old_it) / Σ_t m_it)``
  (geometric mean of the token ratios over the masked response), clipped at sequence level:
  ``l_it = max(−A_it s_i, −A_it clip(s_i, 1 − ε_low, 1 + ε_high))`` with GSPO's own small
  defaults ``ε_low = 3e-4``, ``ε_high = 4e-4`` (Zheng et al., 2025). Implemented as GSPO-token:
  per token ``log s_it = logp_it − sg(logp_it) + sg(log s_i)`` (log clamped at 10), so the value is
  ``s_i`` and, under ``seq_mean_token_mean`` (its default aggregation), the gradient is GSPO's.

A new loss is a kw_only dataclass with ``from_config`` and ``__call__`` plus one entry in
`POLICY_LOSSES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol, Self

import torch
from torch import Tensor

if TYPE_CHECKING:
    from verst.trainer.algorithms.config import AlgorithmConfig

LOG_RATIO_CLAMP = 20.0
"""|logp − logp_old| is clamped to this before exp (PPO)."""
GSPO_LOG_RATIO_MAX = 10.0
"""Upper clamp of GSPO's per-token log sequence ratio (as verl)."""


@dataclass(frozen=True, slots=True)
class PolicyLossTerms:
    """What a policy loss returns: the per-token loss and detached diagnostics."""

    loss: Tensor
    """[B, T] per-token loss (with grad), not yet masked or aggregated."""
    ratio: Tensor
    """[B, T] importance ratio used (token or sequence level), detached."""
    clipped: Tensor
    """[B, T] bool: the clipped branch was taken (the gradient is zero there)."""
    dual_clipped: Tensor
    """[B, T] bool: the dual-clip cap was taken (always False without dual-clip)."""


class PolicyLoss(Protocol):
    """Per-token policy loss. Implementations are kw_only dataclasses (their config)."""

    default_loss_agg: ClassVar[str | None]
    """Aggregation used when `AlgorithmConfig.loss_agg` is None (None = no preference)."""

    @classmethod
    def from_config(cls, config: AlgorithmConfig) -> Self:
        """Build from the algorithm config (picking the fields this loss uses)."""
        ...

    def __call__(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor
    ) -> PolicyLossTerms:
        """logprobs (grad), old_logprobs, advantages, mask: [B, T] → `PolicyLossTerms`."""
        ...


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor]:
    """``max(−A ρ, −A clip(ρ, 1−ε_low, 1+ε_high))`` and where the clipped branch is strictly larger."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


@dataclass(kw_only=True, frozen=True, slots=True)
class PpoClip:
    """PPO clipped surrogate with separate low/high clip and optional dual-clip."""

    eps_clip_low: float = 0.2
    """Lower clip: ratio floor is 1 − eps_clip_low (config: `eps_clip_low`)."""
    eps_clip_high: float = 0.2
    """Upper clip: ratio ceiling is 1 + eps_clip_high; > eps_clip_low is DAPO's clip-higher (config: `eps_clip_high`)."""
    dual_clip_c: float | None = None
    """Dual-clip constant c > 1: for A < 0 the loss is capped at c·|A| (config: `dual_clip_c`)."""
    default_loss_agg: ClassVar[str | None] = None

    @classmethod
    def from_config(cls, config: AlgorithmConfig) -> Self:
        return cls(
            eps_clip_low=config.eps_clip_low,
            eps_clip_high=config.eps_clip_high,
            dual_clip_c=config.dual_clip_c,
        )

    def __call__(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor
    ) -> PolicyLossTerms:
        log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T]
        ratio = torch.exp(log_ratio)
        loss, clipped = _clipped_surrogate(ratio, advantages, self.eps_clip_low, self.eps_clip_high)
        dual = torch.zeros_like(clipped)
        if self.dual_clip_c is not None:
            cap = -advantages * self.dual_clip_c  # = c·|A| where A < 0
            dual = (advantages < 0) & (loss > cap)
            loss = torch.where(dual, cap, loss)
        return PolicyLossTerms(loss=loss, ratio=ratio.detach(), clipped=clipped, dual_clipped=dual)


@dataclass(kw_only=True, frozen=True, slots=True)
class Gspo:
    """GSPO: sequence-level (length-normalised) importance ratio, clipped per sequence."""

    eps_clip_low: float = 3e-4
    """Lower clip of the sequence ratio (config: `gspo_eps_clip_low`; GSPO paper: 3e-4)."""
    eps_clip_high: float = 4e-4
    """Upper clip of the sequence ratio (config: `gspo_eps_clip_high`; GSPO paper: 4e-4)."""
    default_loss_agg: ClassVar[str | None] = "seq_mean_token_mean"

    @classmethod
    def from_config(cls, config: AlgorithmConfig) -> Self:
        return cls(eps_clip_low=config.gspo_eps_clip_low, eps_clip_high=config.gspo_eps_clip_high)

    def __call__(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor
    ) -> PolicyLossTerms:
        log_ratio = logprobs - old_logprobs  # [B, T]
        lengths = mask.sum(-1).clamp(min=1.0)  # [B]
        seq_log_ratio = (log_ratio * mask).sum(-1) / lengths  # [B]
        token_log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)  # [B, T]
        ratio = torch.exp(token_log_ratio.clamp(max=GSPO_LOG_RATIO_MAX))
        loss, clipped = _clipped_surrogate(ratio, advantages, self.eps_clip_low, self.eps_clip_high)
        return PolicyLossTerms(
            loss=loss, ratio=ratio.detach(), clipped=clipped, dual_clipped=torch.zeros_like(clipped)
        )


POLICY_LOSSES: dict[str, type[PolicyLoss]] = {"ppo": PpoClip, "gspo": Gspo}
"""Policy losses by config name (`AlgorithmConfig.policy_loss`)."""
