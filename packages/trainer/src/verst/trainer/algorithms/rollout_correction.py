"""Rollout correction: re-weight or drop tokens where the engine's and the trainer's policies disagree.

The engine samples with its own kernels and precision, so its log-prob of a token
(``logp_rollout``) differs from the trainer's old-policy log-prob (``logp_old``). Each variant
turns the per-token log-ratio ``δ_t = logp_old_t − logp_rollout_t`` (ratio ``ρ_t = exp(δ_t)``,
trainer over engine) into a detached per-token weight ``w_t`` that multiplies the policy loss
``l_t`` before aggregation (so it combines with every policy loss):

- ``none``: ``w_t = 1`` (metrics only, when the engine returned log-probs).
- ``tis`` (token-level truncated IS): ``w_t = min(ρ_t, cap)``.
- ``seq_tis`` (sequence-level TIS, geometric mean): ``w_it = min(ρ̄_i, cap)`` with
  ``ρ̄_i = exp(Σ_t m_it δ_it / Σ_t m_it)``, the geometric mean of the sequence's token ratios.
- ``mis_token`` (token-level masked IS): ``w_t = 1[lo ≤ ρ_t ≤ hi] · (ρ_t if reweight else 1)``:
  tokens outside the band are dropped.
- ``mis_seq`` (sequence-level masked IS): ``w_it = 1[lo ≤ ρ_i ≤ hi] · (ρ_i if reweight else 1)``
  with ``ρ_i`` the geometric mean ``ρ̄_i`` (default) or the product ``exp(Σ_t m_it δ_it)``:
  whole sequences outside the band are dropped.
- ``icepop`` (IcePop, Ring-1T): ``w_t = ρ_t · 1[α ≤ ρ_t ≤ β]`` — token-level MIS with IcePop's
  band (α = 0.5, β = 5.0 by default).

A dropped token keeps its place in the step's normaliser (`LossNorm` counts the loss mask
before correction): its loss is 0 and the kept tokens are not re-scaled. This keeps the sum of
micro-batch losses equal to the full-batch loss without a second pass over the step.
Log-ratios are clamped to [−20, 20] before ``exp``.

Metrics (`correction_metrics`, every variant, whenever rollout log-probs are given), over the
loss mask: ``rc_masked_frac`` (tokens with ``w = 0``), ``rc_masked_seq_frac`` (sequences whose
every token is dropped), ``rc_weight_mean``, ``rc_ratio_q05`` / ``_q50`` / ``_q95`` (token
ratio quantiles), ``rc_ratio_max``, and ``rc_kl_k1`` / ``rc_kl_k3``: estimates of
KL(engine ‖ trainer) from the engine's samples, ``mean(−δ)`` and ``mean(expm1(δ) − δ)``.
An empty mask gives zeros (no NaN).

A new variant is a kw_only dataclass with ``__call__(log_ratio, mask) -> weight`` and a nested
``Config`` (a `RolloutCorrectionConfig`), plus one entry in `ROLLOUT_CORRECTIONS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from pydantic import Field
from torch import Tensor

from verst.rollout.config import Section
from verst.rollout.errors import Problem
from verst.rollout.variants import VariantTable

LOG_RATIO_CLAMP = 20.0
"""|δ| is clamped to this before exp."""
QUANTILES = (0.05, 0.5, 0.95)
"""Token-ratio quantiles reported as ``rc_ratio_qNN``."""


class RolloutCorrection(Protocol):
    """Per-token log-ratio (trainer old − engine) → detached per-token weight (0 = dropped)."""

    def __call__(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        """log_ratio, mask: [B, T] → weight [B, T] (≥ 0; 0 off the mask)."""
        ...

    def own_metrics(self, weight: Tensor, mask: Tensor) -> dict[str, Tensor]:
        """The variant's own metrics besides `correction_metrics` (0-d tensors)."""
        ...


class _Plain:
    """Variants without metrics of their own."""

    __slots__ = ()

    def own_metrics(self, weight: Tensor, mask: Tensor) -> dict[str, Tensor]:
        return {}


class RolloutCorrectionConfig(Section):
    """Base of every variant's config: the ``[algorithm.rollout_correction]`` table (or its name)."""

    type: str = Field(
        "none",
        description="none, tis, seq_tis, mis_token, mis_seq, icepop, or an import path 'pkg.module:Correction'.",
    )

    def build(self) -> RolloutCorrection:
        """The correction this config describes."""
        raise NotImplementedError(f"{type(self).__name__}.build")

    def problems(self, key: str = "algorithm.rollout_correction") -> list[Problem]:
        """This variant's own config problems, keyed under `key`."""
        return []

    @property
    def active(self) -> bool:
        """False only for ``none`` (the loss is not changed)."""
        return True


def _ratio(log_ratio: Tensor) -> Tensor:
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def seq_log_ratio(log_ratio: Tensor, mask: Tensor, *, geometric: bool = True) -> Tensor:
    """Per-sequence log-ratio [B, 1]: the masked mean (geometric mean of ratios) or sum (product).
    An empty row gives 0."""
    total = (log_ratio * mask).sum(-1, keepdim=True)  # [B, 1]
    if not geometric:
        return total
    return total / mask.sum(-1, keepdim=True).clamp(min=1.0)


def _in_band(ratio: Tensor, lo: float, hi: float) -> Tensor:
    return ((ratio >= lo) & (ratio <= hi)).to(ratio.dtype)


def _band_problems(key: str, lo: float, hi: float, lo_name: str = "lo", hi_name: str = "hi") -> list[Problem]:
    if lo < hi:
        return []
    return [
        Problem(
            f"{key}.{lo_name}",
            f"{lo_name} = {lo} >= {hi_name} = {hi}: the band [{lo_name}, {hi_name}] keeps no ratio",
            f"set {lo_name} < {hi_name}, e.g. {lo_name} = 0.5, {hi_name} = 2.0",
        )
    ]


@dataclass(kw_only=True, frozen=True, slots=True)
class NoCorrection(_Plain):
    """Every weight 1 (metrics only)."""

    class Config(RolloutCorrectionConfig):
        """No correction (the metrics are still reported when rollout log-probs are present)."""

        type: Literal["none"] = Field("none", description="No rollout correction.")

        def build(self) -> NoCorrection:
            return NoCorrection()

        @property
        def active(self) -> bool:
            return False

    def __call__(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        return mask.clone()


@dataclass(kw_only=True, frozen=True, slots=True)
class TokenTis:
    """Token-level truncated IS: ``w_t = min(ρ_t, cap)``."""

    cap: float = 2.0

    class Config(RolloutCorrectionConfig):
        """Token-level truncated importance sampling."""

        type: Literal["tis"] = Field("tis", description="Token-level TIS.")
        cap: float = Field(2.0, gt=0, description="Truncation cap of the token weight min(rho_t, cap).")

        def build(self) -> TokenTis:
            return TokenTis(cap=self.cap)

    def __call__(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        return _ratio(log_ratio).clamp(max=self.cap) * mask

    def own_metrics(self, weight: Tensor, mask: Tensor) -> dict[str, Tensor]:
        """``tis_weight_mean`` and ``tis_clip_frac`` (tokens at the cap), the names TIS always had."""
        return {
            "tis_weight_mean": _frac(weight, mask),
            "tis_clip_frac": _frac((weight >= self.cap).to(mask.dtype), mask),
        }


@dataclass(kw_only=True, frozen=True, slots=True)
class SeqTis(_Plain):
    """Sequence-level TIS: ``w_it = min(geometric mean of ρ_i, cap)``."""

    cap: float = 2.0

    class Config(RolloutCorrectionConfig):
        """Sequence-level truncated IS with the geometric mean of the token ratios."""

        type: Literal["seq_tis"] = Field("seq_tis", description="Sequence-level TIS (geometric mean).")
        cap: float = Field(2.0, gt=0, description="Truncation cap of the sequence weight.")

        def build(self) -> SeqTis:
            return SeqTis(cap=self.cap)

    def __call__(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        return _ratio(seq_log_ratio(log_ratio, mask)).clamp(max=self.cap) * mask


@dataclass(kw_only=True, frozen=True, slots=True)
class MisToken(_Plain):
    """Token-level masked IS: tokens with ``ρ_t`` outside ``[lo, hi]`` are dropped."""

    lo: float = 0.5
    hi: float = 2.0
    reweight: bool = True
    """Kept tokens are weighted by ``ρ_t`` (masked IS); False = weight 1 (pure rejection)."""

    class Config(RolloutCorrectionConfig):
        """Token-level masked importance sampling (drop tokens outside [lo, hi])."""

        type: Literal["mis_token"] = Field("mis_token", description="Token-level MIS.")
        lo: float = Field(0.5, ge=0, description="Tokens with ratio < lo are dropped.")
        hi: float = Field(2.0, gt=0, description="Tokens with ratio > hi are dropped.")
        reweight: bool = Field(
            True, description="Weight kept tokens by their ratio (masked IS); false = weight 1 (rejection)."
        )

        def build(self) -> MisToken:
            return MisToken(lo=self.lo, hi=self.hi, reweight=self.reweight)

        def problems(self, key: str = "algorithm.rollout_correction") -> list[Problem]:
            return _band_problems(key, self.lo, self.hi)

    def __call__(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        ratio = _ratio(log_ratio)
        keep = _in_band(ratio, self.lo, self.hi)
        return (keep * ratio if self.reweight else keep) * mask


@dataclass(kw_only=True, frozen=True, slots=True)
class MisSeq(_Plain):
    """Sequence-level masked IS: sequences with ``ρ_i`` outside ``[lo, hi]`` are dropped."""

    lo: float = 0.5
    hi: float = 2.0
    reweight: bool = True
    geometric: bool = True
    """``ρ_i`` is the geometric mean of the token ratios (True) or their product (False)."""

    class Config(RolloutCorrectionConfig):
        """Sequence-level masked importance sampling (drop sequences outside [lo, hi])."""

        type: Literal["mis_seq"] = Field("mis_seq", description="Sequence-level MIS.")
        lo: float = Field(0.5, ge=0, description="Sequences with ratio < lo are dropped.")
        hi: float = Field(2.0, gt=0, description="Sequences with ratio > hi are dropped.")
        reweight: bool = Field(
            True, description="Weight kept sequences by their ratio (masked IS); false = weight 1."
        )
        seq_ratio: Literal["geometric", "product"] = Field(
            "geometric",
            description="The sequence ratio: geometric mean of the token ratios, or their product.",
        )

        def build(self) -> MisSeq:
            return MisSeq(
                lo=self.lo, hi=self.hi, reweight=self.reweight, geometric=self.seq_ratio == "geometric"
            )

        def problems(self, key: str = "algorithm.rollout_correction") -> list[Problem]:
            return _band_problems(key, self.lo, self.hi)

    def __call__(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        ratio = _ratio(seq_log_ratio(log_ratio, mask, geometric=self.geometric))  # [B, 1]
        keep = _in_band(ratio, self.lo, self.hi)
        return (keep * ratio if self.reweight else keep) * mask


@dataclass(kw_only=True, frozen=True, slots=True)
class IcePop(_Plain):
    """IcePop: ``w_t = ρ_t · 1[α ≤ ρ_t ≤ β]``."""

    alpha: float = 0.5
    beta: float = 5.0

    class Config(RolloutCorrectionConfig):
        """IcePop (Ring-1T): keep tokens whose ratio lies in [alpha, beta], weighted by it."""

        type: Literal["icepop"] = Field("icepop", description="IcePop.")
        alpha: float = Field(0.5, ge=0, description="Lower end of the band (IcePop: 0.5).")
        beta: float = Field(5.0, gt=0, description="Upper end of the band (IcePop: 5.0).")

        def build(self) -> IcePop:
            return IcePop(alpha=self.alpha, beta=self.beta)

        def problems(self, key: str = "algorithm.rollout_correction") -> list[Problem]:
            return _band_problems(key, self.alpha, self.beta, "alpha", "beta")

    def __call__(self, log_ratio: Tensor, mask: Tensor) -> Tensor:
        ratio = _ratio(log_ratio)
        return _in_band(ratio, self.alpha, self.beta) * ratio * mask


ROLLOUT_CORRECTIONS: dict[str, type[RolloutCorrection]] = {
    "none": NoCorrection,
    "tis": TokenTis,
    "seq_tis": SeqTis,
    "mis_token": MisToken,
    "mis_seq": MisSeq,
    "icepop": IcePop,
}
"""Rollout corrections by config name (`[algorithm.rollout_correction] type`)."""

ROLLOUT_CORRECTION_CONFIGS: VariantTable[RolloutCorrectionConfig] = VariantTable.of_classes(
    "rollout correction", RolloutCorrectionConfig, ROLLOUT_CORRECTIONS, default="none"
)
"""The config table of `[algorithm.rollout_correction]`."""


def _frac(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def correction_metrics(log_ratio: Tensor, mask: Tensor, weight: Tensor) -> dict[str, Tensor]:
    """0-d metric tensors of one micro-batch (see the module doc); [B, T] inputs, detached."""
    log_ratio, mask, weight = log_ratio.detach(), mask.detach(), weight.detach()
    on = mask > 0
    dropped = ((weight == 0) & on).to(mask.dtype)  # [B, T]
    rows = on.any(-1)  # [B] sequences with loss tokens
    all_dropped = (dropped.sum(-1) == mask.sum(-1)) & rows
    d = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(d)
    picked = ratio[on]  # [n]
    out = {
        "rc_masked_frac": _frac(dropped, mask),
        "rc_masked_seq_frac": all_dropped.to(mask.dtype).sum() / rows.sum().clamp(min=1).to(mask.dtype),
        "rc_weight_mean": _frac(weight, mask),
        "rc_kl_k1": _frac(-d, mask),
        "rc_kl_k3": _frac(torch.expm1(d) - d, mask),
    }
    if picked.numel():
        qs = torch.quantile(
            picked.to(torch.float64), torch.tensor(QUANTILES, dtype=torch.float64, device=picked.device)
        )
        out["rc_ratio_max"] = picked.max()
    else:
        qs = torch.ones(len(QUANTILES), dtype=torch.float64, device=mask.device)
        out["rc_ratio_max"] = mask.new_ones(())
    for q, v in zip(QUANTILES, qs, strict=True):
        out[f"rc_ratio_q{round(q * 100):02d}"] = v
    return out
