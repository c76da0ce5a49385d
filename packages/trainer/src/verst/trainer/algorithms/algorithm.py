"""`Algorithm`: the selected estimator, policy loss, aggregation and KL estimator, composed.

Total loss of a micro-batch — the sum of `terms` (see `verst.trainer.algorithms.terms`) (every term aggregated with the step-global `LossNorm`, so summing
micro-batch losses equals the full-batch loss):

    L = agg(w_t · l_t)  +  kl_coef · agg(KL_est(logp − logp_ref))  [use_kl_loss]
                        −  entropy_coef · agg(H_t)                  [entropy_coef ≠ 0]

with ``l_t`` the policy loss per token (`policy_losses`) and ``w_t`` the rollout correction's
detached weight of ``logp_old − logp_rollout`` (`rollout_correction`; 1 with ``none``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from verst.trainer.algorithms.advantages import AdvantageEstimator
from verst.trainer.algorithms.aggregation import AGGREGATIONS, Aggregation, LossNorm
from verst.trainer.algorithms.config import AlgorithmConfig
from verst.trainer.algorithms.kl import KL_ESTIMATORS, KlEstimator
from verst.trainer.algorithms.policy_losses import PolicyLoss
from verst.trainer.algorithms.rollout_correction import RolloutCorrection
from verst.trainer.algorithms.terms import (
    EntropyTerm,
    KlTerm,
    LossTerm,
    MicroBatch,
    PolicyTerm,
    compose,
    masked_mean,
    to_floats,
)


@dataclass(frozen=True, slots=True)
class LossOutput:
    """The loss of one micro-batch and its diagnostics."""

    loss: Tensor
    """Scalar loss (with grad), already normalised by the step-global `LossNorm`."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Micro-batch diagnostics, token means over its loss mask: pg_loss, clip_frac, ratio_mean, ..."""


def _same_shape(name: str, t: Tensor | None, shape: torch.Size) -> None:
    if t is not None and t.shape != shape:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)} but logprobs has {tuple(shape)}; pass [B, T] tensors"
        )


@dataclass(frozen=True, slots=True)
class Algorithm:
    """The configured RL algorithm: advantages from rewards, and the loss of a micro-batch."""

    config: AlgorithmConfig
    """The config it was built from."""
    estimator: AdvantageEstimator
    """The advantage estimator."""
    policy_loss: PolicyLoss
    """The per-token policy loss."""
    aggregate: Aggregation
    """The loss aggregation (resolved, see `AlgorithmConfig.resolved_loss_agg`)."""
    kl_estimator: KlEstimator
    """The KL estimator (for the KL loss, the KL reward and the `kl` metric)."""
    loss_agg: str
    """Name of the resolved aggregation."""
    correction: RolloutCorrection | None = None
    """The rollout correction (None = ``none``: weight 1, metrics only)."""

    @property
    def needs_reference(self) -> bool:
        """A frozen reference model is needed (kl_coef > 0 with the KL loss or the KL reward)."""
        c = self.config
        return c.kl_coef > 0 and (c.use_kl_loss or c.use_kl_in_reward)

    @property
    def needs_kl_in_reward(self) -> bool:
        """`compute_advantages` needs ``kl`` (= logp_old − logp_ref per token)."""
        return self.config.use_kl_in_reward and self.config.kl_coef > 0

    @property
    def needs_rollout_logprobs(self) -> bool:
        """`loss` needs ``rollout_logprobs`` (a rollout correction, or rollout log-probs as old)."""
        return self.config.rollout_correction.active or self.config.use_rollout_logprobs_as_old

    @property
    def needs_values(self) -> bool:
        """`compute_advantages_and_returns` needs the critic's ``values`` (GAE)."""
        return bool(getattr(self.estimator, "needs_values", False))

    @property
    def needs_old_logprobs(self) -> bool:
        """The trainer must recompute old log-probs (False when rollout log-probs stand in)."""
        return not self.config.use_rollout_logprobs_as_old

    def compute_advantages(self, rewards: Tensor, response_mask: Tensor, kl: Tensor | None = None) -> Tensor:
        """Token-level advantages [G·n, T] float32 (0 where ``response_mask`` is 0).

        rewards: [G, n] (G groups of n samples; sample i = g·n + j is row i below).
        response_mask: [G·n, T] 0/1. kl: [G·n, T] per-token ``logp_old − logp_ref``, required with
        `use_kl_in_reward`; the reward is shaped by ``kl_coef · KL_est(kl)`` per response token.
        """
        return self.compute_advantages_and_returns(rewards, response_mask, kl)[0]

    def compute_advantages_and_returns(
        self,
        rewards: Tensor,
        response_mask: Tensor,
        kl: Tensor | None = None,
        values: Tensor | None = None,
        turn_rewards: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Advantages (as `compute_advantages`) and, for an estimator with values (GAE), the value
        targets (returns) [G·n, T] float32; None for the rest. ``values``: the critic's [G·n, T];
        ``turn_rewards``: per-turn rewards at their tokens [G·n, T] (estimators with `per_turn`)."""
        if turn_rewards is not None and not getattr(self.estimator, "per_turn", False):
            raise ValueError(
                f"advantage estimator {self.config.advantage.type!r} cannot use per-turn rewards "
                f"(rollout.env.reward = 'per_turn'); use gae or grpo_per_turn, or set rollout.env.reward = 'sum'"
            )
        if rewards.dim() != 2:
            raise ValueError(f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}")
        g, n = rewards.shape
        if response_mask.dim() != 2 or response_mask.shape[0] != g * n:
            raise ValueError(
                f"response_mask must be [num_groups*group_size={g * n}, T], got {tuple(response_mask.shape)}"
            )
        mask = response_mask.to(torch.float64)
        penalty = self._kl_penalty(kl, response_mask, mask)
        r = rewards.detach().to(torch.float64)
        turns = None if turn_rewards is None else turn_rewards.detach().to(torch.float64)
        if not self.needs_values:
            if turns is not None:
                adv = self.estimator.with_turn_rewards(r, mask, penalty, turns)  # type: ignore[attr-defined]
                return (adv * mask).to(torch.float32), None
            return (self.estimator(r, mask, penalty) * mask).to(torch.float32), None
        if values is None or values.shape != response_mask.shape:
            got = None if values is None else tuple(values.shape)
            raise ValueError(f"{self.config.advantage.type} needs values [B, T] from the critic, got {got}")
        extra = {} if turns is None else {"turn_rewards": turns}
        adv, returns = self.estimator.with_values(r, mask, penalty, values.detach().to(torch.float64), **extra)  # type: ignore[attr-defined]
        return (adv * mask).to(torch.float32), (returns * mask).to(torch.float32)

    def _kl_penalty(self, kl: Tensor | None, response_mask: Tensor, mask: Tensor) -> Tensor | None:
        """``kl_coef · KL_est(kl)`` per response token with `use_kl_in_reward`, else None."""
        if not self.needs_kl_in_reward:
            return None
        if kl is None:
            raise ValueError(
                "use_kl_in_reward is on: pass kl = logp_old - logp_ref ([B, T]) to compute_advantages"
            )
        if kl.shape != response_mask.shape:
            raise ValueError(f"kl has shape {tuple(kl.shape)}, expected {tuple(response_mask.shape)}")
        return self.config.kl_coef * self.kl_estimator(kl.detach().to(torch.float64)) * mask

    @property
    def terms(self) -> tuple[LossTerm, ...]:
        """The loss terms, summed in this order: policy loss (rollout-corrected), KL, entropy bonus."""
        c = self.config
        return (
            PolicyTerm(self.policy_loss, self.aggregate, correction=self.correction),
            KlTerm(self.kl_estimator, self.aggregate, coef=c.kl_coef, as_loss=c.use_kl_loss),
            EntropyTerm(self.aggregate, coef=c.entropy_coef),
        )

    def micro_batch(
        self,
        logprobs: Tensor,
        old_logprobs: Tensor | None,
        advantages: Tensor,
        mask: Tensor,
        *,
        rollout_logprobs: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
        entropy: Tensor | None = None,
        norm: LossNorm,
        extras: Mapping[str, Tensor] | None = None,
    ) -> tuple[MicroBatch, dict[str, Tensor]]:
        """Check and convert one micro-batch's tensors; also returns the metrics known before any
        term runs (`logprob_mismatch` of old vs rollout log-probs). All tensors `[B, T]`;
        `logprobs` (and `entropy`) carry grad; `old_logprobs` may be None with
        `use_rollout_logprobs_as_old` (then `rollout_logprobs` stands in); `norm` holds the
        normalisers of the whole optimizer step."""
        shape = logprobs.shape
        for name, t in (
            ("old_logprobs", old_logprobs),
            ("advantages", advantages),
            ("mask", mask),
            ("rollout_logprobs", rollout_logprobs),
            ("ref_logprobs", ref_logprobs),
            ("entropy", entropy),
        ):
            _same_shape(name, t, shape)
        if self.needs_rollout_logprobs and rollout_logprobs is None:
            raise ValueError(
                "a rollout correction / use_rollout_logprobs_as_old is on: pass rollout_logprobs "
                "(the engine's log-probs)"
            )
        # low-precision inputs (bf16 log-probs) are computed in float32: exp(ratio) needs the bits
        dtype = torch.promote_types(logprobs.dtype, torch.float32)
        logprobs, advantages, mask = logprobs.to(dtype), advantages.to(dtype), mask.to(dtype)
        old_logprobs, rollout_logprobs, ref_logprobs, entropy = (
            None if x is None else x.to(dtype)
            for x in (old_logprobs, rollout_logprobs, ref_logprobs, entropy)
        )
        metrics: dict[str, Tensor] = {}
        if rollout_logprobs is not None and old_logprobs is not None:
            metrics["logprob_mismatch"] = masked_mean((old_logprobs - rollout_logprobs).abs(), mask)
        if self.config.use_rollout_logprobs_as_old:
            old_logprobs = rollout_logprobs
        if old_logprobs is None:
            raise ValueError("old_logprobs is None: pass them, or set use_rollout_logprobs_as_old = true")
        mb = MicroBatch(
            logprobs=logprobs,
            old_logprobs=old_logprobs.detach(),
            advantages=advantages.detach(),
            mask=mask,
            norm=norm,
            rollout_logprobs=rollout_logprobs,
            ref_logprobs=ref_logprobs,
            entropy=entropy,
            extras=dict(extras or {}),
        )
        return mb, metrics

    def loss_of(self, mb: MicroBatch, metrics: Mapping[str, Tensor] | None = None) -> LossOutput:
        """The algorithm's loss of a micro-batch: its `terms`, summed (metric `loss` = the sum)."""
        total, term_metrics = compose(self.terms, mb)
        assert total is not None  # the policy term always contributes
        out = {**(metrics or {}), **term_metrics, "loss": total}
        return LossOutput(loss=total, metrics=to_floats(out))

    def loss(self, *args: Any, **kwargs: Any) -> LossOutput:
        """Loss of one micro-batch: `micro_batch`'s arguments (tensors `[B, T]`; `logprobs` and
        `entropy` carry grad; `old_logprobs` may be None with `use_rollout_logprobs_as_old`;
        `norm` holds the whole optimizer step's normalisers), then `loss_of`."""
        return self.loss_of(*self.micro_batch(*args, **kwargs))


def build_algorithm(config: AlgorithmConfig) -> Algorithm:
    """Look every part up in its table and build it from ``config`` (raises `ConfigError` if invalid)."""
    config.check()
    loss_agg = config.resolved_loss_agg()
    return Algorithm(
        config=config,
        estimator=config.advantage.build(),
        policy_loss=config.policy_loss.build(),
        aggregate=AGGREGATIONS[loss_agg],
        kl_estimator=KL_ESTIMATORS[config.kl_estimator],
        loss_agg=loss_agg,
        correction=config.rollout_correction.build() if config.rollout_correction.active else None,
    )
