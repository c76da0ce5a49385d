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
- ``cispo`` (`Cispo`): clip the importance weight, not the update (MiniMax-M1, 2025):
  ``l_t = −sg(clip(ρ_t, 1 − ε_low, 1 + ε_high)) · A_t · log π_θ(y_t)``, so every token keeps a
  gradient ``−clip(ρ_t) A_t ∇log π_θ`` (PPO zeroes the clipped ones). Written as
  ``−sg(clip(ρ_t)) · A_t · exp(logp_t − sg(logp_t))``: the same gradient, and the value
  ``−clip(ρ_t) A_t`` reads like PPO's. Defaults ``ε_low = 1`` (no lower clip, as the paper),
  ``ε_high = 0.28``.

Each loss owns its config: a nested ``Config`` (a `PolicyLossConfig`, the
``[algorithm.policy_loss]`` table chosen by ``type``) whose ``build()`` makes it. A new loss is a
kw_only dataclass with ``__call__`` and a nested ``Config``, plus one entry in `POLICY_LOSSES` (or
none: ``type = "pkg.module:MyLoss"`` loads it by import path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

import torch
from pydantic import Field
from torch import Tensor

from verst.rollout.config import Section
from verst.rollout.errors import Problem
from verst.rollout.variants import VariantTable

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
    dual_clipped: Tensor | None = None
    """[B, T] bool: the dual-clip cap was taken; None when the loss has no dual-clip."""


class PolicyLoss(Protocol):
    """Per-token policy loss. Implementations are kw_only dataclasses built by their nested
    ``Config``."""

    default_loss_agg: ClassVar[str | None]
    """Aggregation used when `AlgorithmConfig.loss_agg` is None (None = no preference)."""

    def __call__(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor
    ) -> PolicyLossTerms:
        """logprobs (grad), old_logprobs, advantages, mask: [B, T] → `PolicyLossTerms`."""
        ...


class PolicyLossConfig(Section):
    """Base of every policy loss's config: the ``[algorithm.policy_loss]`` table (or its name)."""

    type: str = Field(
        "ppo",
        description="ppo, gspo, cispo, or an import path 'pkg.module:Loss' (a class with a nested Config).",
    )

    def build(self) -> PolicyLoss:
        """The loss this config describes."""
        raise NotImplementedError(f"{type(self).__name__}.build")

    def problems(self, key: str = "algorithm.policy_loss") -> list[Problem]:
        """This loss's own config problems, keyed under `key`."""
        return []


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
    """Lower clip: ratio floor is 1 − eps_clip_low."""
    eps_clip_high: float = 0.2
    """Upper clip: ratio ceiling is 1 + eps_clip_high; > eps_clip_low is DAPO's clip-higher."""
    dual_clip_c: float | None = None
    """Dual-clip constant c > 1: for A < 0 the loss is capped at c·|A|."""
    default_loss_agg: ClassVar[str | None] = None

    class Config(PolicyLossConfig):
        """PPO clipped surrogate (clip-higher, dual-clip)."""

        type: Literal["ppo"] = Field("ppo", description="PPO clipped surrogate.")
        eps_clip_low: float = Field(
            0.2, ge=0, lt=1, description="The ratio is clipped below at 1 - eps_clip_low."
        )
        eps_clip_high: float = Field(
            0.2, ge=0, description="The ratio is clipped above at 1 + eps_clip_high (clip-higher, e.g. 0.28)."
        )
        dual_clip_c: float | None = Field(
            None,
            description="Dual-clip: for A < 0 the per-token loss is capped at c*|A| (c > 1; None = off).",
        )

        def build(self) -> PpoClip:
            return PpoClip(
                eps_clip_low=self.eps_clip_low, eps_clip_high=self.eps_clip_high, dual_clip_c=self.dual_clip_c
            )

        def problems(self, key: str = "algorithm.policy_loss") -> list[Problem]:
            if self.dual_clip_c is not None and self.dual_clip_c <= 1:
                return [dual_clip_c_problem(f"{key}.dual_clip_c", self.dual_clip_c)]
            return []

    def __call__(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor
    ) -> PolicyLossTerms:
        log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T]
        ratio = torch.exp(log_ratio)
        loss, clipped = _clipped_surrogate(ratio, advantages, self.eps_clip_low, self.eps_clip_high)
        dual = None
        if self.dual_clip_c is not None:
            cap = -advantages * self.dual_clip_c  # = c·|A| where A < 0
            dual = (advantages < 0) & (loss > cap)
            loss = torch.where(dual, cap, loss)
        return PolicyLossTerms(loss=loss, ratio=ratio.detach(), clipped=clipped, dual_clipped=dual)


@dataclass(kw_only=True, frozen=True, slots=True)
class Gspo:
    """GSPO: sequence-level (length-normalised) importance ratio, clipped per sequence."""

    eps_clip_low: float = 3e-4
    """Lower clip of the sequence ratio (GSPO paper: 3e-4)."""
    eps_clip_high: float = 4e-4
    """Upper clip of the sequence ratio (GSPO paper: 4e-4)."""
    default_loss_agg: ClassVar[str | None] = "seq_mean_token_mean"

    class Config(PolicyLossConfig):
        """GSPO: sequence-level importance ratio, clipped per sequence."""

        type: Literal["gspo"] = Field("gspo", description="GSPO.")
        eps_clip_low: float = Field(
            3e-4, ge=0, lt=1, description="Lower clip of the sequence-level ratio (paper: 3e-4)."
        )
        eps_clip_high: float = Field(
            4e-4, ge=0, description="Upper clip of the sequence-level ratio (paper: 4e-4)."
        )

        def build(self) -> Gspo:
            return Gspo(eps_clip_low=self.eps_clip_low, eps_clip_high=self.eps_clip_high)

    def __call__(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor
    ) -> PolicyLossTerms:
        log_ratio = logprobs - old_logprobs  # [B, T]
        lengths = mask.sum(-1).clamp(min=1.0)  # [B]
        seq_log_ratio = (log_ratio * mask).sum(-1) / lengths  # [B]
        token_log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)  # [B, T]
        ratio = torch.exp(token_log_ratio.clamp(max=GSPO_LOG_RATIO_MAX))
        loss, clipped = _clipped_surrogate(ratio, advantages, self.eps_clip_low, self.eps_clip_high)
        return PolicyLossTerms(loss=loss, ratio=ratio.detach(), clipped=clipped)


@dataclass(kw_only=True, frozen=True, slots=True)
class Cispo:
    """CISPO: the clipped importance weight (stop-gradient) times the log-prob gradient."""

    eps_clip_low: float = 1.0
    """The weight is clipped below at 1 − eps_clip_low (1 = no lower clip)."""
    eps_clip_high: float = 0.28
    """The weight is clipped above at 1 + eps_clip_high."""
    default_loss_agg: ClassVar[str | None] = None

    class Config(PolicyLossConfig):
        """CISPO (MiniMax-M1): clipped IS weight, stop-gradient, times log-prob times advantage."""

        type: Literal["cispo"] = Field("cispo", description="CISPO.")
        eps_clip_low: float = Field(
            1.0, ge=0, le=1, description="The IS weight is clipped below at 1 - eps_clip_low (1 = no floor)."
        )
        eps_clip_high: float = Field(
            0.28, ge=0, description="The IS weight is clipped above at 1 + eps_clip_high."
        )

        def build(self) -> Cispo:
            return Cispo(eps_clip_low=self.eps_clip_low, eps_clip_high=self.eps_clip_high)

    def __call__(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor
    ) -> PolicyLossTerms:
        log_ratio = (logprobs.detach() - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, T]
        ratio = torch.exp(log_ratio)
        weight = ratio.clamp(1.0 - self.eps_clip_low, 1.0 + self.eps_clip_high)  # detached
        unit = torch.exp(logprobs - logprobs.detach())  # value 1, gradient ∇logp
        loss = -advantages * weight * unit
        return PolicyLossTerms(loss=loss, ratio=ratio, clipped=weight != ratio)


POLICY_LOSSES: dict[str, type[PolicyLoss]] = {"ppo": PpoClip, "gspo": Gspo, "cispo": Cispo}
"""Policy losses by config name (`[algorithm.policy_loss] type`)."""

POLICY_LOSS_CONFIGS: VariantTable[PolicyLossConfig] = VariantTable.of_classes(
    "policy loss", PolicyLossConfig, POLICY_LOSSES, default="ppo"
)
"""The config table of `[algorithm.policy_loss]` (built-in names, or import paths)."""


def dual_clip_c_problem(key: str, c: float) -> Problem:
    """dual_clip_c must exceed 1."""
    return Problem(
        key,
        f"dual_clip_c = {c} must be > 1 (the cap c*|A| must lie above the clipped loss)",
        "set dual_clip_c = 3.0 (a common value), or None to turn dual-clip off",
    )
