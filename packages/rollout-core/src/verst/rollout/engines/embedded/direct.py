"""The embedded engine's decode step, run module by module under transformers' wrappers.

A decode step through `model(...)` pays, every step, for what one token per row on the engine's
own cache does not need: the output-capturing and config-default decorators of the model's
`forward`, `create_causal_mask` turning the 2-D padding mask into the 4-D one (for one query per
row it is the padding mask itself), the output dataclasses, and per layer the decoder layer's and
attention module's own call machinery, the attention-interface lookup and the cache's wrapper. On
a small model that is a large share of the step. `DirectDecode` runs the same modules in the same
order — `embed_tokens`, `rotary_emb`, per layer the norm, `q/k/v_proj` (and Qwen3's `q_norm` /
`k_norm`), RoPE, the cache layer's `update`, the attention (on CPU up to
`ScoresAttention.MAX_COLS` cache columns transformers' eager arithmetic, `q @ kᵀ → softmax → @ v`,
measured 1.4–1.9× faster there than SDPA's flash kernel for one query per row; else SDPA itself
when every query head has its own KV head, else the model's attention function; the padding
mask made additive once per step), `o_proj`, the norm,
`mlp`; then `norm` and `lm_head` — with the same arithmetic: RMSNorm as `F.rms_norm` on float32
(the same operations as the modules' `forward`, bit for bit), RoPE's `rotate_half(x) · sin` as
`roll(x) · (±sin)` (the same products), its cos/sin read from a table the rotary module made
(`RopeTable`, the same values). The logits equal the full forward's to float rounding (the eager
attention rounds differently from SDPA's; `tests/engines/test_engine_direct_decode.py`). The projections and the MLP are called as modules,
so forward hooks on them (LoRA adapters, MoE router recording) fire as before.

It serves the decoder families whose model `forward` is exactly that loop (`FAMILIES`), with full
attention on SDPA (or the engine's grouped SDPA); anything else (vision-language models, eager
attention, other families) decodes through `model(...)` as before.

Given a `shared_prefix.PrefixKV` (a batch in the split layout, CPU only: `embedded.batch`), the
cache holds each row's own tokens and the attention is `attention.TwoPartAttention` over the
row's group's prompt, kept once, and its own tokens; everything else in the step is the same.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from verst.rollout.engines.embedded.attention import ATTENTION_NAME, ScoresAttention, TwoPartAttention
from verst.rollout.exact_ops import DecodeStep

FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"})
"""transformers model types whose decoder `forward` is embed → mask → rotary → layers → norm, each
layer pre-norm attention (optional q/k norm, standard RoPE) plus a pre-norm MLP, residuals around both."""

_ATTENTION = frozenset({"sdpa", ATTENTION_NAME, "verst_exact"})
"""Attention implementations whose mask is a boolean `[batch, 1, query, keys]` (True = attend)."""

_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx")
_LAYER_PARTS = ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp")


def _rms_norm_fn(norm: Any, fused: bool) -> Any:
    """`norm` as a function: `F.rms_norm` for the families' RMSNorm on float32 (the same
    operations as its forward), else the module itself."""
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if not fused or not type(norm).__name__.endswith("RMSNorm") or weight is None or eps is None:
        return norm
    shape = (weight.shape[-1],)
    return lambda x: F.rms_norm(x, shape, weight, eps)


class DirectDecode:
    """One decode step of a supported causal LM without its wrappers (see the module doc)."""

    def __init__(self, model: Any) -> None:
        self.config = model.config
        self.lm_head = model.lm_head
        self.body = model.model
        self.layers = list(model.model.layers[: model.config.num_hidden_layers])
        fused = next(model.parameters()).dtype == torch.float32
        self.final_norm = _rms_norm_fn(model.model.norm, fused)
        self.norms = [
            (_rms_norm_fn(layer.input_layernorm, fused), _rms_norm_fn(layer.post_attention_layernorm, fused))
            for layer in self.layers
        ]
        self.qk_norms = [
            (_rms_norm_fn(layer.self_attn.q_norm, fused), _rms_norm_fn(layer.self_attn.k_norm, fused))
            if hasattr(layer.self_attn, "q_norm")
            else None
            for layer in self.layers
        ]
        self.rope = RopeTable.of(model.model.rotary_emb)
        self.scores = ScoresAttention()
        """The attention of CPU steps on at most `ScoresAttention.MAX_COLS` columns (else SDPA)."""
        self.two_part = TwoPartAttention()
        """The attention of steps over a split cache (a `shared_prefix.PrefixKV` given)."""
        self.exact = model.config._attn_implementation == "verst_exact"
        """`train.exact_on_policy` (`embedded.exact`): every layer calls the model's attention function."""
        if self.exact:
            self.scores = None

    @classmethod
    def of(cls, model: Any) -> DirectDecode | None:
        """The direct step for `model`, or None when it must decode through `model(...)`."""
        cfg = model.config
        if getattr(cfg, "model_type", None) not in FAMILIES or cfg._attn_implementation not in _ATTENTION:
            return None
        if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
            return None
        body = getattr(model, "model", None)
        parts = ("embed_tokens", "layers", "norm", "rotary_emb")
        if body is None or not hasattr(model, "lm_head") or not all(hasattr(body, p) for p in parts):
            return None
        for layer in body.layers:
            attn = getattr(layer, "self_attn", None)
            if attn is None or not all(hasattr(attn, p) for p in _ATTN_PARTS):
                return None
            if not all(hasattr(layer, p) for p in _LAYER_PARTS):
                return None
        return cls(model)

    def __call__(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any, prefix: Any = None
    ) -> torch.Tensor:
        """ids [batch, 1], mask [batch, cols] (1 = attend; the fed token's column included),
        pos [batch, 1] → the next-token logits [batch, vocab]. With `prefix` (a
        `shared_prefix.PrefixKV`), `cache` and `mask` hold each row's own tokens only and every
        row also attends to its group's prompt there (`attention.TwoPartAttention`)."""
        hidden = self.body.embed_tokens(ids)  # [batch, 1, hidden]
        # [batch, 1, 1, cols]: one query sees its padding mask, as the additive mask SDPA makes of
        # a boolean one (0 / -inf), once per step instead of once per layer
        bias = torch.zeros((*mask.shape[:1], 1, 1, mask.shape[1]), dtype=hidden.dtype, device=hidden.device)
        bias.masked_fill_(mask[:, None, None, :] == 0, float("-inf"))
        cols = mask.shape[1]
        if prefix is not None:  # [batch, 1, 1, prompt + own]
            bias, cols = torch.cat([prefix.bias, bias], dim=-1), cols + prefix.width
        rope = self.rope(hidden, pos, cols)  # (cos, signed sin), [batch, 1, 1, head_dim] each
        attention = DecodeStep(bias) if self.exact else self.attention()
        attend = partial(self._attend, bias, self.scores_for(hidden, cols), attention, prefix)
        for i, layer in enumerate(self.layers):
            hidden = self.layer(i, layer, hidden, cache.layers[layer.self_attn.layer_idx], rope, attend)
        return self.lm_head(self.final_norm(hidden))[:, -1]

    def scores_for(self, hidden: torch.Tensor, cols: int) -> ScoresAttention | None:
        """The step's `ScoresAttention` (CPU, at most `MAX_COLS` columns, not exact), else None."""
        cpu = hidden.device.type == "cpu"
        return self.scores if cpu and cols <= ScoresAttention.MAX_COLS and not self.exact else None

    def attention(self) -> Any:
        """The model's attention function (transformers' registry)."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]

    def layer(
        self, i: int, layer: Any, hidden: torch.Tensor, kv: Any, rope: tuple[torch.Tensor, ...], attend: Any
    ) -> torch.Tensor:
        """One decoder layer on hidden [b, t, hidden_size] (the families' forward, inlined): norm,
        `q/k/v_proj` (and q/k norms), RoPE (`rope`, `[b, 1, t, head_dim]` each), then
        `attend(attn, kv, q, k, v)` (q, k, v `[b, heads, t, d]` after RoPE; `kv` the cache layer)
        → `[b, t, heads, d]`-shaped attention output, `o_proj`, the norm and the MLP with their
        residuals. The decode step feeds one token per row (t = 1, `_attend`); the ragged verify
        forward (`speculative/ragged.py`) each row's `k + 1` tokens, or packed tokens one per entry."""
        attn, (pre, post) = layer.self_attn, self.norms[i]
        b, t, d = hidden.shape[0], hidden.shape[1], attn.head_dim
        x = pre(hidden)
        q = attn.q_proj(x).view(b, t, -1, d)  # [b, t, heads, d]
        k = attn.k_proj(x).view(b, t, -1, d)
        if self.qk_norms[i] is not None:
            q, k = self.qk_norms[i][0](q), self.qk_norms[i][1](k)
        v = attn.v_proj(x).view(b, t, -1, d).transpose(1, 2)  # [b, kv_heads, t, d]
        q, k = _rope(q.transpose(1, 2), rope), _rope(k.transpose(1, 2), rope)
        out = attend(attn, kv, q, k, v)
        hidden = hidden + attn.o_proj(out.reshape(b, t, -1))
        return hidden + layer.mlp(post(hidden))

    def _attend(
        self,
        bias: torch.Tensor,
        scores: Any,
        attention: Any,
        prefix: Any,
        attn: Any,
        kv: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:
        """A decode step's attention (one query per row): append k, v to the cache layer `kv`,
        then the attention its case calls for (the step's 4-D mask `bias`, `scores` a
        `ScoresAttention` or None, `attention` the model's function, `prefix` or None) → `[batch,
        1, heads, d]`."""
        k, v = kv.update(k, v)  # [batch, kv_heads, cols, d]
        if self.exact:  # the step's mask made once; split cache: each row's [prompt ; own] keys,
            keys, values = [k], [v]  # its prompt's gathered per row (the KV stays stored once)
            if prefix is not None:
                j = attn.layer_idx
                keys, values = [prefix.keys[j][prefix.group], k], [prefix.values[j][prefix.group], v]
            out = attention(q, keys, values, attn.scaling)
        elif prefix is not None:  # split cache: the group's prompt once, then the row's own tokens
            j = attn.layer_idx
            out = self.two_part(
                q, (prefix.keys[j], prefix.values[j], prefix.layout), k, v, bias, attn.scaling
            )
        elif scores is not None:  # CPU, short cache: two batched matmuls (`attention.ScoresAttention`)
            out = scores(q, k, v, bias, attn.scaling)
        elif q.shape[1] == k.shape[1]:  # one query head per KV head: SDPA itself (what both functions call)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=attn.scaling)
            out = out.transpose(1, 2)
        else:
            out, _ = attention(attn, q, k, v, bias, dropout=0.0, scaling=attn.scaling)
        return out


def _rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """`x · cos + rotate_half(x) · sin` as `x · cos + roll(x) · (−sin_a, sin_b)`: the same products.
    x [batch, heads, 1, d]."""
    cos, signed_sin = rope
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """`(−sin_a, sin_b)` over the two halves of the last dimension: `_rope`'s factor of `roll(x)`."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


class RopeTable:
    """Each position's RoPE `(cos, signed sin)`, computed once by the model's rotary module.

    The rotary module's forward is elementwise in the position (`pos · inv_freq`, then `cos`,
    `sin`, the scaling), so its values at position p do not depend on which other positions it
    is given: a table of positions `0..n-1`, made by that module, holds the very values a step's
    call would compute — and a step reads its rows with one `index_select` instead of the
    module's dozen operations plus its decorators. The table grows (doubling) to the step's
    column count, which bounds every live row's position (a row attends all its own tokens, and
    dead slots sit at position 0). Dynamic and LongRoPE types change their frequencies with the
    sequence length: they run the module every step (`ModuleRope`).
    """

    MIN_ROWS = 256

    def __init__(self, rotary: Any) -> None:
        self.rotary = rotary
        self.table: torch.Tensor | None = None  # [n, 2, 1, 1, head_dim]: cos, signed sin
        self.key: tuple[Any, ...] = ()

    @classmethod
    def of(cls, rotary: Any) -> RopeTable | ModuleRope:
        kind = getattr(rotary, "rope_type", None)
        static = isinstance(kind, str) and "dynamic" not in kind and kind != "longrope"
        return cls(rotary) if static and hasattr(rotary, "inv_freq") else ModuleRope(rotary)

    def __call__(self, hidden: torch.Tensor, pos: torch.Tensor, cols: int) -> tuple[torch.Tensor, ...]:
        """hidden [batch, 1, hidden_size] (dtype, device), pos [batch, 1] with every value below
        `cols` → (cos, signed sin), `[batch, 1, 1, head_dim]` each."""
        inv = self.rotary.inv_freq
        key = (id(inv), inv.data_ptr(), hidden.dtype, hidden.device)
        table = self.table
        if table is None or table.shape[0] < cols or key != self.key:
            n = max(cols, self.MIN_ROWS, 2 * table.shape[0] if table is not None and key == self.key else 0)
            table = self.table = self._build(hidden, n)
            self.key = key
        return table.index_select(0, pos.view(-1)).unbind(1)

    def _build(self, hidden: torch.Tensor, n: int) -> torch.Tensor:
        positions = torch.arange(n, device=hidden.device)[None]  # [1, n]
        cos, sin = self.rotary(hidden[:0], position_ids=positions)  # [1, n, head_dim] each
        return torch.stack([cos[0], _signed_sin(sin)[0]], dim=1)[:, :, None, None]  # [n, 2, 1, 1, head_dim]


class ModuleRope:
    """RoPE `(cos, signed sin)` from the rotary module at every step (frequencies that change)."""

    def __init__(self, rotary: Any) -> None:
        self.rotary = rotary

    def __call__(self, hidden: torch.Tensor, pos: torch.Tensor, cols: int) -> tuple[torch.Tensor, ...]:
        cos, sin = self.rotary(hidden, position_ids=pos)  # [batch, 1, head_dim] each
        return cos[:, None], _signed_sin(sin)[:, None]  # [b, 1, 1, d] each
