"""The critic's value loss (PPO with a value model; the advantages are `advantages.Gae`).

The loss of a micro-batch (``clip`` = ε_v, None = no clipping; as verl's ``compute_value_loss``
and OpenRLHF's ``ValueLoss``):

    l_t = ½ max((V_t − R_t)², (V_old_t + clip(V_t − V_old_t, −ε_v, ε_v) − R_t)²)

with ``V`` the critic's values (with grad), ``V_old`` its values before the step's updates and
``R`` the GAE returns, aggregated as ``token_mean`` with the step-global `LossNorm` over the model
tokens (so micro-batch losses sum to the full-batch loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from verst.trainer.algorithms.aggregation import LossNorm, token_mean


@dataclass(frozen=True, slots=True)
class ValueLossOutput:
    """The value loss of a micro-batch and its 0-d metric tensors."""

    loss: Tensor
    metrics: dict[str, Tensor]


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, norm: LossNorm, clip: float | None
) -> ValueLossOutput:
    """The (clipped) value loss above. values (grad), old_values, returns, mask: [b, T]."""
    old_values, returns = old_values.detach(), returns.detach()
    err = (values - returns).square()
    if clip is None:
        per_token = 0.5 * err
        clipped = torch.zeros_like(mask, dtype=torch.bool)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        err_clip = (v_clip - returns).square()
        per_token = 0.5 * torch.maximum(err, err_clip)
        clipped = err_clip > err
    loss = token_mean(per_token, mask, norm)
    n = mask.sum().clamp(min=1e-8)
    v = values.detach()
    return ValueLossOutput(
        loss,
        {
            "vf_loss": loss.detach(),
            "vf_clip_frac": (clipped.to(mask.dtype) * mask).sum() / n,
            "value_mean": (v * mask).sum() / n,
            "vf_abs_err": ((v - returns).abs() * mask).sum() / n,
        },
    )


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """``1 − Var(R − V) / Var(R)`` over the masked tokens (0 when the returns do not vary)."""
    on = mask > 0
    if int(on.sum()) < 2:
        return 0.0
    r, v = returns[on].double(), values[on].double()
    var = r.var()
    return 0.0 if float(var) == 0.0 else float(1 - (r - v).var() / var)
