"""Grouped-query attention for the embedded engine without copying the KV cache.

transformers' SDPA attention repeats every key/value head `num_heads / num_kv_heads` times
(`repeat_kv`) whenever an attention mask is given on CPU/CUDA — and the engine always gives one
(its rows have different lengths). In a decode step that copy is the whole KV cache, times the
group size, in every layer: at SmolLM2's shapes (3 query heads per KV head) it writes three
times the cache each step, more than the step's matmuls. `grouped_sdpa` instead folds each KV
head's query heads into the query-length dimension — `[b, kv, rep * t, d]` against the
unrepeated `[b, kv, L, d]` keys, the mask repeated over the `rep` query rows — which is the
same attention, row for row, with no copy of the cache. Prefill without a mask (causal, no
padding) keeps transformers' own path, where causality is per query position.

`use_grouped_sdpa(model)` switches a model the engine owns to it (registered once under
`ATTENTION_NAME` in transformers' attention and mask registries; idempotent).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTENTION_NAME = "verst_grouped_sdpa"
"""The name the attention function (and its mask function, transformers' SDPA mask) is registered under."""


def grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,  # [b, heads, t, d]
    key: torch.Tensor,  # [b, kv_heads, L, d]
    value: torch.Tensor,  # [b, kv_heads, L, d]
    attention_mask: torch.Tensor | None,  # [b or 1, 1, t, L] bool (True = attend) or additive
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns `([b, t, heads, d], None)`."""
    b, heads, t, d = query.shape
    kv = key.shape[1]
    rep = heads // kv
    if rep == 1 or (attention_mask is None and t > 1) or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    q = query.reshape(b, kv, rep * t, d)  # query head kv * rep + r, position i -> row r * t + i
    mask = attention_mask
    if mask is not None:
        mb, mh, mt, ml = mask.shape
        mask = mask[:, :, None].expand(mb, mh, rep, mt, ml).reshape(mb, mh, rep * mt, ml)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )  # [b, kv, rep * t, d]
    return out.reshape(b, heads, t, d).transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model: Any) -> bool:
    """Switch `model` (a transformers causal LM on SDPA with grouped KV heads) to `grouped_sdpa`.

    Returns whether it switched: models on another attention implementation, or with one KV
    head per query head, are left as they are."""
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    if getattr(cfg, "_attn_implementation", None) != "sdpa" or not heads or kv == heads:
        return False
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, grouped_sdpa)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    model.set_attn_implementation(ATTENTION_NAME)
    return True


class ScoresAttention:
    """A decode step's attention as transformers' eager attention computes it: `q @ kᵀ · scale
    + mask → softmax (float32) → @ v`, each KV head's query heads folded into one matrix
    (`[b, kv, rep, d]` against the unrepeated `[b, kv, L, d]`).

    Why: with one query per row, CPU SDPA's flash kernel runs two tiny GEMMs and a softmax per
    (row, head) and at the engine's shapes takes 1.4–1.9× the time of these two batched
    matmuls (64 rows, 4 heads × 32, 65–300 cache columns; 3 × 3 heads × 64 at 100 columns; the
    flash kernel wins again from about 500 columns). Not bit-identical to SDPA (its
    online softmax rounds differently, ~5e-7 here): the same attention to float rounding."""

    MAX_COLS = 256
    """Cache columns up to which `DirectDecode` uses it on CPU (measured faster up to ~300)."""

    def __call__(
        self,
        query: torch.Tensor,  # [b, heads, t, d]
        key: torch.Tensor,  # [b, kv_heads, L, d]
        value: torch.Tensor,  # [b, kv_heads, L, d]
        bias: torch.Tensor,  # [b, 1, t, L] additive (0 = attend, -inf = masked)
        scaling: float,
    ) -> torch.Tensor:
        """→ `[b, t, heads, d]`. t > 1: a speculative verify forward's `k + 1` queries per row
        (`speculative/ragged.py`), folded the same way (`[b, kv, rep · t, d]`, the mask repeated
        over the `rep` query heads)."""
        b, heads, t, d = query.shape
        kv = key.shape[1]
        rep = heads // kv
        q = query.reshape(b, kv, rep * t, d)  # query head kv * rep + r, position i -> row r * t + i
        if t > 1:
            bias = bias[:, :, None].expand(b, 1, rep, t, bias.shape[-1]).reshape(b, 1, rep * t, -1)
        scores = torch.matmul(q, key.transpose(-1, -2)).mul_(scaling).add_(bias)  # [b, kv, rep · t, L]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(probs, value)  # [b, kv, rep · t, d]
        return out.reshape(b, 1, heads, d) if t == 1 else out.reshape(b, heads, t, d).transpose(1, 2)


class TwoPartAttention:
    """`ScoresAttention`'s arithmetic over a split cache: each row attends to its group's prompt
    keys, kept once per group (`shared_prefix.PrefixKV`), then to its own generated keys.

    Why: a GRPO group's rows share their prompt, most of the cache; with the prompt's KV copied
    into every row, a decode step reads it once per row. Here the group's rows' queries (all
    their query heads, folded per KV head: `[groups, kv, size · rep, d]`) meet the unrepeated
    prompt keys in one batched matmul, so each prompt is read once per step per layer. Scores
    of both parts are joined into one row (`[slots, kv, rep, prefix + own]`), masked, soft-maxed
    once (float32, as transformers' eager attention), and the weighted sums of both value parts
    added: the same attention as `ScoresAttention` over `[prompt ; own]`, the value sum split in
    two (float rounding apart). CPU only, like `ScoresAttention` (`embedded.batch` gates it).

    Measured (1 thread, 64 rows = 8 groups × 8, prompts padded to 250 columns, 1–128 own
    columns): one layer's attention 1.1–2.8 ms against SDPA's 3.2–4.5 ms (2 KV heads × 3) and
    1.5–3.6 ms against 4.0–5.6 ms (3 × 3); the 31.5M scale benchmark's decode (attention ~18% of
    it, the linear layers ~65%) 5–10% shorter, the 135M one's ~15%."""

    def __call__(
        self,
        query: torch.Tensor,  # [slots, heads, 1, d]
        prefix: tuple[torch.Tensor, torch.Tensor, Any],  # keys, values [groups, kv, P, d], GroupLayout
        key: torch.Tensor,  # [slots, kv_heads, L, d] each row's own
        value: torch.Tensor,  # [slots, kv_heads, L, d]
        bias: torch.Tensor,  # [slots, 1, 1, P + L] additive (0 = attend, -inf = masked)
        scaling: float,
    ) -> torch.Tensor:
        """→ `[slots, 1, heads, d]`."""
        pk, pv, layout = prefix
        b, heads, _, d = query.shape
        kv, width = key.shape[1], pk.shape[2]
        q = query.reshape(b, kv, heads // kv, d)  # query head kv * rep + r -> [b, kv, r, d]
        shared = torch.matmul(layout.to_grid(q), pk.transpose(-1, -2))  # [groups, kv, size * rep, P]
        own = torch.matmul(q, key.transpose(-1, -2))  # [b, kv, rep, L]
        scores = layout.join(shared, own).mul_(scaling).add_(bias)  # [b, kv, rep, P + L]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        out = layout.to_slots(torch.matmul(layout.to_grid(probs[..., :width]), pv))  # [b, kv, rep, d]
        return out.add_(torch.matmul(probs[..., width:], value)).reshape(b, 1, heads, d)
