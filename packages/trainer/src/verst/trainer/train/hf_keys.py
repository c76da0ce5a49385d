"""A Hugging Face checkpoint's tensors under the names of the model in memory.

transformers 5 keeps some weights in memory in another layout than on disk: MoE families fuse
their experts into one tensor per projection (`mlp.experts.gate_up_proj`, `[experts, 2 × inter,
hidden]`) while `save_pretrained` writes the original per-expert weights
(`mlp.experts.<i>.gate_proj.weight`, ...), reverting the model's conversion mapping
(`core_model_loading.revert_weight_conversion`). Loading a checkpoint back into a live model
(resume) therefore has to apply that mapping forward, as `from_pretrained` does
(`get_model_conversion_mapping` + `rename_source_key` + each `WeightConverter`'s operations), and
copy the result into the existing parameters: `from_pretrained`'s own loader replaces the
`nn.Parameter` objects, which would cut them off from the optimizer. Models without a conversion
mapping (dense families) come back unchanged.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

import torch


def to_model_keys(model: Any, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` as `save_pretrained` wrote it, renamed and converted to `model.state_dict()`'s
    names and layouts (fused MoE experts stacked in expert order)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    mapping = get_model_conversion_mapping(model)
    if not mapping:
        return dict(state_dict)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None) or None
    names = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    pending: dict[str, WeightConverter] = {}
    # natural order (experts.2 before experts.10): MergeModulelist stacks in arrival order
    for key, tensor in sorted(state_dict.items(), key=lambda kv: dot_natural_key(kv[0])):
        target, pattern = rename_source_key(key, renamings, converters, prefix, names)
        if target not in names and key in names:  # as the loader: a key that needed no renaming
            target, pattern = key, None
        if pattern is None:
            out[target] = tensor
            continue
        pending.setdefault(target, deepcopy(by_pattern[pattern])).add_tensor(target, key, pattern, tensor)
    for target, converter in pending.items():
        for name, value in converter.convert(target, model=model, config=model.config).items():
            out[name] = value[0] if isinstance(value, list) else value
    return out
