"""Switch a transformers causal LM to the batch-invariant ops of `verst.rollout.exact_ops`.

`install_exact(model)` is what `train.exact_on_policy` does to the embedded engine's model and to
the trainer's policy (the same function on both sides): every `nn.Linear` runs `exact_linear`,
the MLP's SiLU is `exact_silu`, an MoE's routers and experts run `exact_router` and
`exact_experts`, and the attention is `exact_attention` (registered with
transformers' attention and mask registries under `ATTENTION_NAME`). The trainer computes its
log-probs with `exact_ops.exact_linear` + `exact_logprobs` (`train.logprob_backend` "exact"), the
engine reports `exact_logprobs` of the same logits (`engines.embedded.exact`).

`exact_problems(config, dtype)` says why a model cannot run it (a family not covered, another
activation, router jitter, sliding windows, 16-bit weights); callers refuse the setting with that line.
"""

from __future__ import annotations

from typing import Any

import torch

from verst.rollout.exact_ops import exact_attention, exact_experts, exact_linear, exact_router, exact_silu

ATTENTION_NAME = "verst_exact"
"""The attention implementation name `install_exact` registers and sets."""

FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"})
"""Decoder families whose layers are exactly embed → (RMSNorm, q/k/v/o projections, RoPE,
attention) + (RMSNorm, gate/up/down with SiLU) → RMSNorm → LM head: every op is covered. The MoE
families (`MOE_FAMILIES`) replace the MLP by a softmax top-k router (`exact_ops.exact_router`)
and fused SiLU experts (`exact_ops.exact_experts`): covered too."""

MOE_FAMILIES = frozenset({"qwen3_moe", "mixtral"})
"""MoE families of `FAMILIES`: their router is a `*TopKRouter` (`verst.rollout.moe.ROUTER_CLASSES`,
softmax → top-k → renormalise) and their experts a `*Experts` module with fused `gate_up_proj`
`[E, 2I, H]` and `down_proj` `[E, H, I]` (no shared expert). Qwen2-MoE (a shared expert with a
sigmoid gate) and OLMoE are not covered: not checked here."""

ROUTERS = frozenset({"Qwen3MoeTopKRouter", "MixtralTopKRouter"})
EXPERTS = frozenset({"Qwen3MoeExperts", "MixtralExperts"})


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
    if getattr(text, "router_jitter_noise", 0.0):
        out.append("router jitter noise (router_jitter_noise > 0) is random in training")
    if getattr(text, "attention_dropout", 0.0):
        out.append("attention dropout is not batch-invariant")
    if dtype != "float32":
        out.append(f"dtype {dtype!r}: only float32 is covered")
    return out


def _linear_forward(module: torch.nn.Linear) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return exact_linear(x, module.weight, module.bias)

    return forward


def _router_forward(module: torch.nn.Module) -> Any:
    def forward(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = hidden.reshape(-1, module.hidden_dim)
        return exact_router(h, module.weight, module.top_k, getattr(module, "norm_topk_prob", True))

    return forward


def _experts_forward(module: torch.nn.Module) -> Any:
    def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return exact_experts(hidden, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj)

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
        kind = type(module).__name__
        if kind in ROUTERS:  # its own F.linear: not an nn.Linear
            module.forward = _router_forward(module)  # type: ignore[method-assign]
        elif kind in EXPERTS:  # replaces transformers' experts dispatch (grouped_mm / batched_mm / eager)
            module.forward = _experts_forward(module)  # type: ignore[method-assign]
        elif kind.endswith(("Router", "Experts")):
            raise ValueError(f"exact_on_policy: MoE module {kind} is not covered")
    _register()
    model.set_attn_implementation(ATTENTION_NAME)
    model.verst_exact = True


def is_exact(model: Any) -> bool:
    """Whether `install_exact` ran on `model`."""
    return bool(getattr(model, "verst_exact", False))
