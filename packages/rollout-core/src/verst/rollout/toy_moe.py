"""Tiny mixture-of-experts models the project builds itself (random init from a config).

Two of transformers 5's MoE families, the same shapes for both: Qwen3-MoE (softmax top-k,
renormalised with `norm_topk_prob`) and Mixtral (softmax top-k, always renormalised, float32
gate weights). Default: 8 experts, top-2, hidden 128, 4 layers — about 1.1M parameters, with the
character tokenizer of `verst.rollout.toy`. Saved in the ordinary Hugging Face layout, so every
path afterwards is the one a user's MoE checkpoint takes. Needs the `local` extra.

    make_tiny_moe_checkpoint("model/init", family="qwen3_moe")
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from verst.rollout.toy import decoder_fields, save_with_char_tokenizer

MOE_FAMILIES = ("qwen3_moe", "mixtral")
"""The families `build_tiny_moe` makes (both route in a `*TopKRouter`)."""


def tiny_moe_config(
    family: str,
    vocab_size: int,
    *,
    num_experts: int = 8,
    top_k: int = 2,
    expert_size: int = 64,
    **decoder: Any,
) -> Any:
    """The transformers config of a tiny `family` MoE (full attention, no shared experts);
    `decoder`: `verst.rollout.toy.decoder_fields`' keywords (hidden size, layers, heads, ...)."""
    import transformers

    common = {
        **decoder_fields(vocab_size, **decoder),
        "num_experts_per_tok": top_k,
        "router_aux_loss_coef": 0.0,
    }
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            num_experts=num_experts,
            moe_intermediate_size=expert_size,
            intermediate_size=2 * common["hidden_size"],
            norm_topk_prob=True,
            head_dim=common["hidden_size"] // common["num_attention_heads"],
        )
    if family == "mixtral":
        return transformers.MixtralConfig(
            **common, num_local_experts=num_experts, intermediate_size=expert_size, sliding_window=None
        )
    raise ValueError(f"unknown MoE family {family!r}; choose one of {', '.join(MOE_FAMILIES)}")


def build_tiny_moe(family: str, vocab_size: int, *, seed: int = 0, **config_kwargs: Any) -> Any:
    """A randomly initialised tiny MoE causal LM (float32)."""
    import torch
    import transformers

    config = tiny_moe_config(family, vocab_size, **config_kwargs)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def make_tiny_moe_checkpoint(
    path: str | Path, *, family: str = "qwen3_moe", seed: int = 0, **kw: Any
) -> Path:
    """Build the char tokenizer and a tiny MoE and save both to `path` (HF layout)."""
    return save_with_char_tokenizer(path, functools.partial(build_tiny_moe, family, seed=seed, **kw))
