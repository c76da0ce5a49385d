"""Advantage estimators: rewards of groups of samples → token-level advantages.

Inputs (see `AdvantageEstimator.__call__`): ``rewards`` ``[G, n]`` (G groups of n samples, sample
``i = g·n + j`` is row ``i`` of the token tensors), ``mask`` ``[G·n, T]`` (1 on response tokens),
and an optional per-token KL penalty ``p`` ``[G·n, T]`` (already ``kl_coef · KL_est``, zero off the
mask) when the KL is shaped into the reward. Outcome estimators score sample ``i`` with
``s_i = r_i − Σ_t p_it`` and broadcast their scalar advantage over the response tokens.
All of them compute in float64; all-equal scores in a group give exactly zero advantages.

- ``grpo``: ``A_i = (s_i − mean_g s) / (std_g s + ε)`` (unbiased std, ε = 1e-6) when
  ``normalize_std``, else ``s_i − mean_g s``. A single-sample group gets 0.
- ``dr_grpo``: ``A_i = s_i − mean_g s`` (Dr.GRPO, "Understanding R1-Zero-Like Training"); pairs with
  the ``seq_mean_token_sum_norm`` aggregation, its default.
- ``rloo``: ``A_i = s_i − 1/(n−1) Σ_{j≠i} s_j`` (leave-one-out baseline); n = 1 gives 0.
- ``reinforce_pp``: token rewards ``ρ_it = r_i·[t = last response token] − p_it``, return-to-go
  ``R_it = Σ_{u≥t} γ^{u−t} ρ_iu``, then whitening over every response token of the batch:
  ``A = (R − mean) / sqrt(var + 1e-8)`` (unbiased var). REINFORCE++ (Hu, 2025).
- ``reinforce_pp_baseline``: ``s_i − mean_g s`` broadcast over the response, then the same
  batch-wide whitening (REINFORCE++-baseline; verl's ``reinforce_plus_plus_baseline``).
- ``gae``: GAE(γ, λ) from a value model (PPO with a critic; Schulman et al., 2016), over the
  *model tokens* only (mask = 1; tool / observation tokens and padding are skipped, the next
  model token is the next state): ``δ_t = ρ_t + γ V_t' − V_t`` (``V = 0`` after the last model
  token), ``A_t = δ_t + γλ A_t'``, returns ``R_t = A_t + V_t`` (the critic's target), then the
  advantages are batch-whitened (``whiten``, default). Called as ``with_values(...)``, which also
  returns ``R``; needs ``[algorithm.critic]`` (`critic_config`, value loss in `value_loss`).

Each estimator owns its config: a nested ``Config`` (an `AdvantageConfig`, the
``[algorithm.advantage]`` table chosen by ``type``) whose ``build()`` makes it. A new estimator is
a kw_only dataclass with ``__call__`` and a nested ``Config``, plus one entry in
`ADVANTAGE_ESTIMATORS` (or none: ``type = "pkg.module:MyEstimator"`` loads it by import path).
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

WHITEN_EPS = 1e-8
"""Added to the variance in batch whitening (REINFORCE++), as verl's ``masked_whiten``."""


class AdvantageEstimator(Protocol):
    """Rewards → token-level advantages. Implementations are kw_only dataclasses built by their
    nested ``Config``."""

    default_loss_agg: ClassVar[str | None]
    """Aggregation used when `AlgorithmConfig.loss_agg` is None (None = no preference)."""
    needs_values: ClassVar[bool]
    """True for estimators that read a value model's values (`Gae`: called through
    ``with_values``); False (or absent, for estimators from an import path) for the rest."""

    def __call__(self, rewards: Tensor, mask: Tensor, kl_penalty: Tensor | None) -> Tensor:
        """rewards [G, n], mask [G·n, T], kl_penalty [G·n, T] or None → advantages [G·n, T] (float64)."""
        ...


class AdvantageConfig(Section):
    """Base of every estimator's config: the ``[algorithm.advantage]`` table (or just its name)."""

    type: str = Field(
        "grpo",
        description=(
            "grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, gae, grpo_per_turn, or an import path "
            "'pkg.module:Estimator' (a class with a nested Config)."
        ),
    )

    def build(self) -> AdvantageEstimator:
        """The estimator this config describes."""
        raise NotImplementedError(f"{type(self).__name__}.build")

    def problems(self, key: str = "algorithm.advantage") -> list[Problem]:
        """This estimator's own config problems, keyed under `key`."""
        return []


def group_center(scores: Tensor) -> Tensor:
    """``s − mean_g s`` per row of ``scores`` [G, n], exactly 0 where a group's scores are equal.

    Shifting by the group's first score before averaging makes equal scores cancel exactly.
    """
    shifted = scores - scores[:, :1]  # [G, n]
    return shifted - shifted.mean(dim=1, keepdim=True)


def group_std(scores: Tensor) -> Tensor:
    """Unbiased std per group of ``scores`` [G, n] → [G, 1]; 0 for single-sample groups."""
    if scores.shape[1] < 2:
        return torch.zeros_like(scores[:, :1])
    return scores.std(dim=1, keepdim=True, unbiased=True)


def outcome_scores(rewards: Tensor, kl_penalty: Tensor | None) -> Tensor:
    """``s_i = r_i − Σ_t p_it`` as [G, n]."""
    if kl_penalty is None:
        return rewards
    return rewards - kl_penalty.sum(-1).reshape(rewards.shape)


def broadcast(per_sample: Tensor, mask: Tensor) -> Tensor:
    """Per-sample advantages [G, n] → token-level [G·n, T] (0 off the mask)."""
    return per_sample.reshape(-1, 1) * mask


def masked_whiten(values: Tensor, mask: Tensor) -> Tensor:
    """``(x − mean) / sqrt(var + 1e-8)`` over the tokens where ``mask`` is 1 (unbiased var), 0 elsewhere.

    values, mask: [B, T]. Fewer than two masked tokens → zero variance.
    """
    on = mask > 0
    n = int(on.sum())
    if n == 0:
        return torch.zeros_like(values)
    picked = values[on]  # [n]
    shifted = picked - picked[0]  # equal values cancel exactly
    centered = shifted - shifted.mean()
    var = centered.square().sum() / (n - 1) if n > 1 else centered.new_zeros(())
    out = torch.zeros_like(values)
    out[on] = centered * torch.rsqrt(var + WHITEN_EPS)
    return out


def last_token_index(mask: Tensor) -> Tensor:
    """Index of the last 1 in each row of ``mask`` [B, T] → [B] (-1 for an empty row)."""
    t = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask > 0, t, torch.full_like(t, -1)).amax(dim=1)


def token_rewards(rewards: Tensor, mask: Tensor, kl_penalty: Tensor | None) -> Tensor:
    """``r_i`` at the last mask position of each row, minus the per-token KL penalty: rewards
    [G, n] (or [B]), mask [B, T] → [B, T]."""
    flat = rewards.reshape(-1)  # [B]
    last = last_token_index(mask)  # [B]
    out = torch.zeros_like(mask)
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] = flat[rows]
    if kl_penalty is not None:
        out = out - kl_penalty * mask
    return out


def discounted_returns(token_rewards: Tensor, gamma: float) -> Tensor:
    """``R_t = Σ_{u≥t} γ^{u−t} ρ_u`` along dim 1 of ``token_rewards`` [B, T]."""
    if gamma == 1.0:
        return token_rewards.flip(1).cumsum(1).flip(1)
    out = torch.empty_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        running = token_rewards[:, t] + gamma * running
        out[:, t] = running
    return out


@dataclass(kw_only=True, frozen=True, slots=True)
class Grpo:
    """GRPO: group-relative advantage, optionally divided by the group std."""

    normalize_std: bool = True
    """Divide by the group's (unbiased) std + eps."""
    eps: float = 1e-6
    """Added to the std before dividing."""
    default_loss_agg: ClassVar[str | None] = None
    needs_values: ClassVar[bool] = False

    class Config(AdvantageConfig):
        """GRPO: group-relative advantage, optionally divided by the group std."""

        type: Literal["grpo"] = Field("grpo", description="GRPO.")
        normalize_std: bool = Field(
            True, description="Divide the group-centred reward by the group std (+1e-6)."
        )

        def build(self) -> Grpo:
            return Grpo(normalize_std=self.normalize_std)

    def __call__(self, rewards: Tensor, mask: Tensor, kl_penalty: Tensor | None) -> Tensor:
        scores = outcome_scores(rewards, kl_penalty)  # [G, n]
        adv = group_center(scores)
        if self.normalize_std:
            adv = adv / (group_std(scores) + self.eps)
        return broadcast(adv, mask)


@dataclass(kw_only=True, frozen=True, slots=True)
class DrGrpo:
    """Dr.GRPO: ``s_i − mean_g s``, no std normalisation; default aggregation seq_mean_token_sum_norm."""

    default_loss_agg: ClassVar[str | None] = "seq_mean_token_sum_norm"
    needs_values: ClassVar[bool] = False

    class Config(AdvantageConfig):
        """Dr.GRPO: group-centred reward, no std normalisation."""

        type: Literal["dr_grpo"] = Field("dr_grpo", description="Dr.GRPO.")

        def build(self) -> DrGrpo:
            return DrGrpo()

    def __call__(self, rewards: Tensor, mask: Tensor, kl_penalty: Tensor | None) -> Tensor:
        return broadcast(group_center(outcome_scores(rewards, kl_penalty)), mask)


@dataclass(kw_only=True, frozen=True, slots=True)
class Rloo:
    """RLOO: ``s_i − mean_{j≠i} s_j`` = ``n/(n−1) · (s_i − mean_g s)``; 0 for single-sample groups."""

    default_loss_agg: ClassVar[str | None] = None
    needs_values: ClassVar[bool] = False

    class Config(AdvantageConfig):
        """RLOO: leave-one-out baseline."""

        type: Literal["rloo"] = Field("rloo", description="RLOO.")

        def build(self) -> Rloo:
            return Rloo()

    def __call__(self, rewards: Tensor, mask: Tensor, kl_penalty: Tensor | None) -> Tensor:
        scores = outcome_scores(rewards, kl_penalty)  # [G, n]
        n = scores.shape[1]
        if n < 2:
            return torch.zeros_like(mask)
        return broadcast(group_center(scores) * (n / (n - 1)), mask)


@dataclass(kw_only=True, frozen=True, slots=True)
class ReinforcePP:
    """REINFORCE++: per-token discounted return of (last-token reward − KL penalty), batch-whitened."""

    gamma: float = 1.0
    """Discount of the return-to-go."""
    default_loss_agg: ClassVar[str | None] = None
    needs_values: ClassVar[bool] = False

    class Config(AdvantageConfig):
        """REINFORCE++: per-token discounted return, batch-whitened."""

        type: Literal["reinforce_pp"] = Field("reinforce_pp", description="REINFORCE++.")
        gamma: float = Field(1.0, gt=0, le=1, description="Discount of the per-token return-to-go.")

        def build(self) -> ReinforcePP:
            return ReinforcePP(gamma=self.gamma)

    def __call__(self, rewards: Tensor, mask: Tensor, kl_penalty: Tensor | None) -> Tensor:
        returns = discounted_returns(token_rewards(rewards, mask, kl_penalty), self.gamma)  # [B, T]
        return masked_whiten(returns, mask)


@dataclass(kw_only=True, frozen=True, slots=True)
class ReinforcePPBaseline:
    """REINFORCE++-baseline: ``s_i − mean_g s`` broadcast over the response, then batch-whitened."""

    default_loss_agg: ClassVar[str | None] = None
    needs_values: ClassVar[bool] = False

    class Config(AdvantageConfig):
        """REINFORCE++-baseline: group-centred reward, batch-whitened."""

        type: Literal["reinforce_pp_baseline"] = Field(
            "reinforce_pp_baseline", description="REINFORCE++-baseline."
        )

        def build(self) -> ReinforcePPBaseline:
            return ReinforcePPBaseline()

    def __call__(self, rewards: Tensor, mask: Tensor, kl_penalty: Tensor | None) -> Tensor:
        centered = group_center(outcome_scores(rewards, kl_penalty))  # [G, n]
        return masked_whiten(broadcast(centered, mask), mask)


def gae(
    token_reward: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Advantages and returns ``[B, T]`` over the masked positions (others skipped, 0 in the output).

    token_reward, values, mask: [B, T]."""
    adv = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])  # [B] A at the next model token
    next_value = torch.zeros_like(values[:, 0])  # [B] V at the next model token (0 past the last)
    for t in range(values.shape[1] - 1, -1, -1):
        on = mask[:, t] > 0
        delta = token_reward[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * running
        adv[:, t] = torch.where(on, a, torch.zeros_like(a))
        running = torch.where(on, a, running)
        next_value = torch.where(on, values[:, t], next_value)
    returns = (adv + values) * mask
    return adv, returns


@dataclass(kw_only=True, frozen=True, slots=True)
class Gae:
    """GAE(γ, λ) from the critic's values; needs ``[algorithm.critic]``."""

    gamma: float = 1.0
    lam: float = 0.95
    whiten: bool = True
    """Whiten the advantages over the batch's model tokens (the returns are not whitened)."""
    default_loss_agg: ClassVar[str | None] = None
    needs_values: ClassVar[bool] = True
    per_turn: ClassVar[bool] = True
    """Uses per-turn rewards (`rollout.env.reward = "per_turn"`) as the token rewards."""

    class Config(AdvantageConfig):
        """GAE(gamma, lambda) advantages from a value model (PPO with a critic)."""

        type: Literal["gae"] = Field("gae", description="GAE (needs [algorithm.critic]).")
        gamma: float = Field(1.0, gt=0, le=1, description="Discount between model tokens.")
        lam: float = Field(0.95, ge=0, le=1, description="GAE lambda (1 = Monte-Carlo return minus value).")
        whiten: bool = Field(True, description="Whiten the advantages over the batch's model tokens.")

        def build(self) -> Gae:
            return Gae(gamma=self.gamma, lam=self.lam, whiten=self.whiten)

    def __call__(self, rewards: Tensor, mask: Tensor, kl_penalty: Tensor | None) -> Tensor:
        raise TypeError("gae needs the critic's values: call with_values(rewards, mask, kl_penalty, values)")

    def with_values(
        self,
        rewards: Tensor,
        mask: Tensor,
        kl_penalty: Tensor | None,
        values: Tensor,
        turn_rewards: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """rewards [G, n], mask / kl_penalty / values [G·n, T] → (advantages, returns) [G·n, T];
        `turn_rewards` [G·n, T] (per-turn rewards at each turn's last token) replace the
        episode reward at the last token."""
        values = values * mask
        if turn_rewards is None:
            tok = token_rewards(rewards, mask, kl_penalty)
        else:
            tok = turn_rewards * mask - (kl_penalty * mask if kl_penalty is not None else 0.0)
        adv, returns = gae(tok, values, mask, self.gamma, self.lam)
        if self.whiten:
            adv = masked_whiten(adv, mask)
        return adv, returns


@dataclass(kw_only=True, frozen=True, slots=True)
class GrpoPerTurn:
    """GRPO with per-turn rewards: a token's advantage is its return-to-go (the rewards of its
    turn and the later ones, minus the KL penalty from it on) minus the group's mean episode
    return, divided by the group's std of the episode return. At the first token it is GRPO's
    advantage; a later turn is credited only with what comes after it."""

    normalize_std: bool = True
    eps: float = 1e-6
    default_loss_agg: ClassVar[str | None] = None
    needs_values: ClassVar[bool] = False
    per_turn: ClassVar[bool] = True

    class Config(AdvantageConfig):
        """GRPO over per-turn rewards (rollout.env.reward = 'per_turn'; docs/algorithms.md)."""

        type: Literal["grpo_per_turn"] = Field("grpo_per_turn", description="GRPO over per-turn rewards.")
        normalize_std: bool = Field(True, description="Divide by the group std of the episode return (+1e-6).")

        def build(self) -> GrpoPerTurn:
            return GrpoPerTurn(normalize_std=self.normalize_std)

    def __call__(self, rewards: Tensor, mask: Tensor, kl_penalty: Tensor | None) -> Tensor:
        """Without per-turn rewards the episode reward sits on the last token: GRPO."""
        return self.with_turn_rewards(rewards, mask, kl_penalty, token_rewards(rewards, mask, None))

    def with_turn_rewards(
        self, rewards: Tensor, mask: Tensor, kl_penalty: Tensor | None, turn_rewards: Tensor
    ) -> Tensor:
        """rewards [G, n], mask / kl_penalty / turn_rewards [G·n, T] → advantages [G·n, T]."""
        g, n = rewards.shape
        tok = turn_rewards * mask - (kl_penalty * mask if kl_penalty is not None else 0.0)
        to_go = discounted_returns(tok, 1.0).view(g, n, -1)  # [G, n, T]
        episode = outcome_scores(rewards, kl_penalty)  # [G, n]: r_i = Σ_t ρ_t, minus the penalty
        first = episode[:, :1]  # shifting by it makes equal returns cancel exactly (group_center)
        adv = (to_go - first.unsqueeze(-1)) - (episode - first).mean(dim=1, keepdim=True).unsqueeze(-1)
        if self.normalize_std:
            adv = adv / (group_std(episode).unsqueeze(-1) + self.eps)
        return adv.reshape(g * n, -1) * mask


ADVANTAGE_ESTIMATORS: dict[str, type[AdvantageEstimator]] = {
    "grpo": Grpo,
    "dr_grpo": DrGrpo,
    "rloo": Rloo,
    "reinforce_pp": ReinforcePP,
    "reinforce_pp_baseline": ReinforcePPBaseline,
    "gae": Gae,
    "grpo_per_turn": GrpoPerTurn,
}
"""Advantage estimators by config name (`[algorithm.advantage] type`)."""

ADVANTAGES: VariantTable[AdvantageConfig] = VariantTable.of_classes(
    "advantage estimator", AdvantageConfig, ADVANTAGE_ESTIMATORS, default="grpo"
)
"""The config table of `[algorithm.advantage]` (built-in names, or import paths)."""
