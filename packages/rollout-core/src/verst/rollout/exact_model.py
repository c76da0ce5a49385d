"""Switch a transformers causal LM to the batch-invariant ops of `verst.rollout.exact_ops`.

`install_exact(model)` is what `train.exact_on_policy` does to the embedded engine's model and to
the trainer's policy (the same function on both sides): every `nn.Linear` runs `exact_linear`,
the MLP's SiLU is `exact_silu`, and the attention is `exact_attention` (registered with
transformers' attention and mask registries under `ATTENTION_NAME`). The trainer computes its
log-probs with `exact_ops.exact_linear` + `exact_logprobs` (`train.logprob_backend` "exact"), the
engine reports `exact_logprobs` of the same logits (`engines.embedded.exact`).

`exact_problems(config, dtype)` says why a model cannot run it (a family not covered, another
activation, MoE, sliding windows, 16-bit weights); callers refuse the setting with that line.
"""

from __future__ import annotations

from typing import Any

import torch

from verst.rollout.exact_ops import exact_attention, exact_linear, exact_silu

ATTENTION_NAME = "verst_exact"
"""The attention implementation name `install_exact` registers and sets."""

FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""Dense decoder families whose layers are exactly embed → (RMSNorm, q/k/v/o projections, RoPE,
attention) + (RMSNorm, gate/up/down with SiLU) → RMSNorm → LM head: every op is covered."""


def exact_problems(config: Any, dtype: str) -> list[str]:
    """Why `config` (a transformers config) in `dtype` cannot run exactly on-policy; [] = it can."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kind = getattr(text, "model_type", None)
    out: list[str] = []
    if kind not in FAMILIES:
        out.append(f"model type {kind!r} is not covered (covered: {', '.join(sorted(FAMILIES))})")
    if getattr(text, "hidden_act", "silu") != "silu":
        out.append(f"activation {text.hidden_act!r} is not covered (only silu)")
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        out.append("sliding-window attention is not covered")
    if any(getattr(text, k, 0) for k in ("num_experts", "num_local_experts")):
        out.append("MoE models are not covered")
    if getattr(text, "attention_dropout", 0.0):
        out.append("attention dropout is not batch-invariant")
    if dtype != "float32":
        out.append(f"dtype {dtype!r}: only float32 is covered")
    return out


def _linear_forward(module: torch.nn.Linear) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return exact_linear(x, module.weight, module.bias)

    return forward


class ExactSiLU(torch.nn.Module):
    """`exact_ops.exact_silu` as a module (it replaces an MLP's `act_fn`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exact_silu(x)


def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, exact_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def install_exact(model: Any) -> None:
    """Put `model` on the batch-invariant ops (in place, idempotent). Raises ValueError with the
    reasons when `exact_problems` has any."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    problems = exact_problems(model.config, dtype)
    if problems:
        raise ValueError("exact_on_policy: " + "; ".join(problems))
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = _linear_forward(module)  # type: ignore[method-assign]
        if hasattr(module, "act_fn") and isinstance(module.act_fn, torch.nn.Module):
            module.act_fn = ExactSiLU()
    _register()
    model.set_attn_implementation(ATTENTION_NAME)
    model.verst_exact = True


def is_exact(model: Any) -> bool:
    """Whether `install_exact` ran on `model`."""
    return bool(getattr(model, "verst_exact", False))
