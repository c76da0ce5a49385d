"""Loss terms: the pieces a micro-batch's loss is the sum of, behind one small protocol.

A term takes one `MicroBatch` (every tensor a term may read, `[b, T]`, plus the step-global
`LossNorm`) and returns its part of the loss (None = it adds nothing) and its metrics. The
algorithm's terms are the policy loss (with the rollout correction), the KL to the
reference and the entropy bonus (`Algorithm.terms`); a step extension such as on-policy
distillation adds its own (`OpdTopKTerm`), fed by the same micro-batch (its `extras`). `compose`
sums them in order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from verst.trainer.algorithms.aggregation import Aggregation, LossNorm
from verst.trainer.algorithms.kl import KlEstimator
from verst.trainer.algorithms.policy_losses import PolicyLoss
from verst.trainer.algorithms.rollout_correction import NoCorrection, RolloutCorrection, correction_metrics


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """What the loss of one micro-batch is computed from (all `[b, T]`, one dtype and device)."""

    logprobs: Tensor
    """The policy's log-probs of the sampled tokens (with grad)."""
    old_logprobs: Tensor
    """The old policy's (detached; the rollout's when they stand in)."""
    advantages: Tensor
    """Token advantages (detached)."""
    mask: Tensor
    """Loss mask (1 on trained response tokens)."""
    norm: LossNorm
    """Normalisers of the whole optimizer step."""
    rollout_logprobs: Tensor | None = None
    """The engine's log-probs (TIS)."""
    ref_logprobs: Tensor | None = None
    """The frozen reference's log-probs (KL)."""
    entropy: Tensor | None = None
    """Per-token entropy (with grad; entropy bonus)."""
    extras: Mapping[str, Tensor] = field(default_factory=dict)
    """Per-token tensors of step extensions' forwards (e.g. `opd_topk_kl`)."""


@dataclass(frozen=True, slots=True)
class TermOutput:
    """A term's part of the loss (None = nothing) and its 0-d metric tensors."""

    loss: Tensor | None
    metrics: dict[str, Tensor] = field(default_factory=dict)


class LossTerm(Protocol):
    """One part of the micro-batch loss."""

    def __call__(self, mb: MicroBatch) -> TermOutput: ...


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over ``mask`` (0 for an empty mask), detached, as a 0-d tensor (no host sync)."""
    return (x.detach().to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1e-8)


def to_floats(metrics: Mapping[str, Tensor]) -> dict[str, float]:
    """0-d metric tensors → Python floats with a single device-to-host copy."""
    if not metrics:
        return {}
    values = torch.stack([v.detach().to(torch.float64).reshape(()) for v in metrics.values()]).tolist()
    return dict(zip(metrics, values, strict=True))


def compose(terms: Sequence[LossTerm], mb: MicroBatch) -> tuple[Tensor | None, dict[str, Tensor]]:
    """The sum of the terms' losses (in order) and all their metrics."""
    total: Tensor | None = None
    metrics: dict[str, Tensor] = {}
    for term in terms:
        out = term(mb)
        metrics.update(out.metrics)
        if out.loss is not None:
            total = out.loss if total is None else total + out.loss
    return total, metrics


@dataclass(frozen=True, slots=True)
class PolicyTerm:
    """``agg(w_t · l_t)``: the per-token policy loss, weighted by the rollout correction, aggregated."""

    policy_loss: PolicyLoss
    aggregate: Aggregation
    correction: RolloutCorrection | None = None
    """Turns ``logp_old − logp_rollout`` into the detached weight ``w_t`` (None = weight 1). Its
    metrics (`correction_metrics`) are reported whenever rollout log-probs are given."""

    def __call__(self, mb: MicroBatch) -> TermOutput:
        mask = mb.mask
        terms = self.policy_loss(mb.logprobs, mb.old_logprobs, mb.advantages, mask)
        per_token = terms.loss  # [b, T]
        metrics: dict[str, Tensor] = {}
        if mb.rollout_logprobs is not None:
            log_ratio = (mb.old_logprobs - mb.rollout_logprobs).detach()  # [b, T] trainer − engine
            correction = self.correction or NoCorrection()
            weight = correction(log_ratio, mask).detach()  # [b, T]
            if self.correction is not None:
                per_token = per_token * weight
            metrics.update(correction_metrics(log_ratio, mask, weight))
            metrics.update(correction.own_metrics(weight, mask))
        elif self.correction is not None:
            raise ValueError("a rollout correction is on: pass rollout_logprobs (the engine's log-probs)")
        pg_loss = self.aggregate(per_token, mask, mb.norm)
        metrics["pg_loss"] = pg_loss
        metrics["clip_frac"] = masked_mean(terms.clipped.to(mask.dtype), mask)
        if terms.dual_clipped is not None:
            metrics["dual_clip_frac"] = masked_mean(terms.dual_clipped.to(mask.dtype), mask)
        metrics["ratio_mean"] = masked_mean(terms.ratio, mask)
        metrics["ratio_max"] = torch.where(mask > 0, terms.ratio, torch.zeros_like(terms.ratio)).max()
        metrics["approx_kl"] = masked_mean(mb.old_logprobs - mb.logprobs.detach(), mask)  # k1 of old vs new
        return TermOutput(pg_loss, metrics)


@dataclass(frozen=True, slots=True)
class KlTerm:
    """``kl_coef · agg(KL_est(logp − logp_ref))`` when the KL is a loss; the `kl` metric always."""

    estimator: KlEstimator
    aggregate: Aggregation
    coef: float = 0.0
    as_loss: bool = False

    def __call__(self, mb: MicroBatch) -> TermOutput:
        active = self.as_loss and self.coef > 0
        if mb.ref_logprobs is None:
            if active:
                raise ValueError("use_kl_loss is on: pass ref_logprobs (the frozen reference's log-probs)")
            return TermOutput(None)
        kl = self.estimator(mb.logprobs - mb.ref_logprobs.detach())  # [b, T]
        metrics = {"kl": masked_mean(kl, mb.mask)}
        if not active:
            return TermOutput(None, metrics)
        kl_loss = self.aggregate(kl, mb.mask, mb.norm)
        metrics["kl_loss"] = kl_loss
        return TermOutput(self.coef * kl_loss, metrics)


@dataclass(frozen=True, slots=True)
class EntropyTerm:
    """``−entropy_coef · agg(H_t)``; the `entropy` metric whenever entropy is given."""

    aggregate: Aggregation
    coef: float = 0.0

    def __call__(self, mb: MicroBatch) -> TermOutput:
        if mb.entropy is None:
            if self.coef != 0:
                raise ValueError("entropy_coef != 0: pass entropy ([B, T]) to the loss")
            return TermOutput(None)
        metrics = {"entropy": masked_mean(mb.entropy, mb.mask)}
        if self.coef == 0:
            return TermOutput(None, metrics)
        return TermOutput(-(self.coef * self.aggregate(mb.entropy, mb.mask, mb.norm)), metrics)
