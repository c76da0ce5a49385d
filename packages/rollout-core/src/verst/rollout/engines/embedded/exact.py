"""The embedded engine under `train.exact_on_policy` (`verst.rollout.exact_model`).

`enable_exact(batch)` puts the batch's model on the batch-invariant ops and turns off what would
bypass them: the direct decode step's own attentions (`ScoresAttention`, SDPA: every layer calls
the model's attention function, then `exact_attention`). The split layout of shared prompts
stays: its prompt KV is kept once per group, and each step gathers a row's `[prompt ; own]`
keys for `exact_attention` instead of `TwoPartAttention`'s split sums (`embedded.direct`).
Prefix sharing at prefill stays as configured: a shared prompt's KV is the same bits as each
row's own prefill would be. LoRA adapters apply PEFT's ops (`embedded.lora`), MoE routers and
experts run `exact_router` / `exact_experts` (`install_exact`). `exact_step_scores` is what a
step reports: `exact_logprobs` of the step's logits, the trainer's op.
"""

from __future__ import annotations

from typing import Any

import torch

from verst.rollout.engines.embedded.direct import DirectDecode
from verst.rollout.engines.embedded.sampling import StepScores
from verst.rollout.exact_model import install_exact
from verst.rollout.exact_ops import exact_logprobs


def enable_exact(batch: Any) -> None:
    """Switch a `DecodeBatch` (idle: no rows yet) and its model to exact on-policy decoding."""
    if batch.rows:
        raise RuntimeError("exact_on_policy must be enabled before the engine decodes")
    install_exact(batch.model)
    batch.direct = DirectDecode.of(batch.model)  # its layers then call exact_attention
    batch.exact = True


def exact_step_scores(logits: torch.Tensor, inv_temp: torch.Tensor) -> StepScores:
    """The step's log-probs as `exact_logprobs` computes them, with a zero log-sum-exp, so
    `StepScores.of(tokens)` is exactly the trainer's value."""
    unit = bool((inv_temp == 1.0).all())  # x * 1 is x: skip the pass, as the trainer's T = 1 does
    lp = exact_logprobs(logits, 1.0 if unit else inv_temp)
    return StepScores(lp, lp.new_zeros((lp.shape[0], 1)))
