"""The verify forward, ragged: each row computes only its own `1 + proposals` tokens.

The padded verify forward (`model(...)` on `[slots, k + 1]`) runs every slot's `k + 1` positions
through every projection, MLP and the LM head, although a row proposing `m < k` tokens (or none:
gated off, paused by its back-off, nothing found) needs `m + 1` of them; at many rows on a CPU,
where a forward's cost is its tokens, that padding was a quarter to a half of a verify step's
tokens (64 rows of the tiny model, `docs/engines.md`). Here the real tokens are packed into one
`[tokens, 1, hidden]` column and every per-token module (embedding, norms, `q/k/v_proj`, RoPE,
`o_proj`, the MLP, the final norm and `lm_head`) runs on them only: each layer is
`DirectDecode.layer` itself (its norms, its RoPE table, the same arithmetic), given this module's
attention. Only the attention sees the slot layout: the packed queries, keys and values are
scattered into `[slots, heads, k + 1, d]` (padding positions zero; where nothing is padded, e.g.
one row, the tokens run as `[slots, k + 1, hidden]` throughout and nothing is scattered), the
keys and values appended to the cache as the padded forward appends them (so the rollback,
`step._advance`, masks the same columns: a row's positions past its accepted ones, padding
included), and the attention runs with the padding mask plus the causal mask inside the new
block — what `model(...)`'s `create_causal_mask` makes of them — as the decode step's:
`attention.ScoresAttention` on CPU up to its `MAX_COLS` columns (the eager arithmetic, the
`k + 1` queries folded per KV head), else the model's attention function.

Used where the plain step is direct (`batch.direct`) and nothing needs the slot layout of every
module's input: not with LoRA adapters (their per-row selection is by slot) or MoE routing
capture (recorded per slot and position); those keep the padded `model(...)` forward.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from verst.rollout.engines.embedded.direct import DirectDecode


def usable(batch: Any) -> bool:
    """Whether `batch`'s verify forward can be ragged (see the module doc)."""
    d = batch.direct
    return (
        d is not None
        and not d.exact
        and batch.prefix is None
        and batch.adapters is None
        and batch.routers is None
    )


def verify_logits(
    direct: DirectDecode,
    ids: torch.Tensor,
    widths: torch.Tensor,
    mask: torch.Tensor,
    pos: torch.Tensor,
    cache: Any,
) -> torch.Tensor:
    """ids [slots, W] (each row's last token then its proposals, padded), widths [slots] long
    (each row's real tokens, 1 … W), mask [slots, cols] (1 = attend; the W new columns included),
    pos [slots, W] → logits [slots, W, vocab] (zero at padding positions)."""
    slots, w = ids.shape
    cols = mask.shape[1]
    if slots == 1 or bool((widths == w).all()):  # no padding (e.g. one row): the slot layout itself
        hidden = direct.body.embed_tokens(ids)  # [slots, W, hidden]
        cos, sin = direct.rope(hidden, pos.reshape(-1, 1), cols)  # [slots · W, 1, 1, head_dim]
        rope = (cos.view(slots, 1, w, -1), sin.view(slots, 1, w, -1))
        at = None
    else:  # packed: one real token per entry, scattered into the slot layout for the attention
        real = (torch.arange(w, device=ids.device)[None] < widths[:, None]).view(-1)  # [slots · W]
        at = real.nonzero()[:, 0]  # packed token → its (slot, position) in the padded layout
        hidden = direct.body.embed_tokens(ids.view(-1)[at])[:, None]  # [T, 1, hidden]
        rope = direct.rope(hidden, pos.reshape(-1)[at][:, None], cols)  # [T, 1, 1, head_dim] each
    bias = torch.zeros((slots, 1, w, cols), dtype=hidden.dtype, device=hidden.device)
    bias.masked_fill_(mask[:, None, None, :] == 0, float("-inf"))
    ahead = torch.ones((w, w), dtype=torch.bool, device=hidden.device).triu(1)  # a later new token
    bias[:, :, :, cols - w :].masked_fill_(ahead, float("-inf"))
    attend = partial(_attend, bias, direct.scores_for(hidden, cols), direct.attention())
    if at is not None:
        attend = partial(_attend_packed, (slots, w, at), attend)
    for i, layer in enumerate(direct.layers):
        hidden = direct.layer(i, layer, hidden, cache.layers[layer.self_attn.layer_idx], rope, attend)
    packed = _head(direct.lm_head, direct.final_norm(hidden).reshape(-1, hidden.shape[-1]))  # [T, vocab]
    if at is None:  # no padding: the packed logits are the layout
        return packed.view(slots, w, -1)
    logits = packed.new_zeros((slots * w, packed.shape[-1]))
    logits[at] = packed
    return logits.view(slots, w, -1)


def _attend(
    bias: torch.Tensor,
    scores: Any,
    attention: Any,
    attn: Any,
    kv: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    """`DirectDecode.layer`'s attention for `W` new tokens per slot (q, k, v `[slots, heads, W,
    d]`): k and v appended to the cache layer `kv` as the padded forward appends them, then
    `scores` (a `ScoresAttention`: CPU, a short cache) or the model's `attention` with `bias`
    (padding plus the causal mask inside the new block) → `[slots, W, heads, d]`."""
    keys, values = kv.update(k, v)  # [slots, kv_heads, cols, d]
    if scores is not None:
        return scores(q, keys, values, bias, attn.scaling)
    out, _ = attention(attn, q, keys, values, bias, dropout=0.0, scaling=attn.scaling)
    return out


def _attend_packed(
    shape: tuple[int, int, torch.Tensor], attend: Any, attn: Any, kv: Any, *qkv: torch.Tensor
) -> torch.Tensor:
    """`attend` (`_attend` with the step's bias and attention bound) for packed tokens (q, k, v
    `[T, heads, 1, d]`): scattered into the slot layout (zero at padding), attended, gathered
    back → packed `[T, heads · d]`."""
    out = attend(attn, kv, *(_scatter(x, shape) for x in qkv))
    return out.reshape(shape[0] * shape[1], -1)[shape[2]]  # [slots · W, heads · d] → the real tokens


SKINNY = 8
"""At most this many packed tokens (and more than one), the LM head runs as `W @ xᵀ` on CPU."""


def _head(head: Any, x: torch.Tensor) -> torch.Tensor:
    """The LM head on packed x [T, hidden] → [T, vocab]. A verify forward of one row has 2 … k + 1
    tokens; for so few rows MKL's `x @ Wᵀ` (`F.linear`) measured 1.5–4× slower on this box's CPU
    (AMD EPYC, one thread) than `W @ xᵀ` at SmolLM2-135M's head (49152 × 576, 10–20 ms of a
    60–90 ms forward); the logits agree to float rounding. A plain
    `nn.Linear` without bias or hooks only; else the module itself."""
    if (
        type(head) is torch.nn.Linear
        and head.bias is None
        and not head._forward_hooks
        and not head._forward_pre_hooks
        and x.device.type == "cpu"
        and 1 < x.shape[0] <= SKINNY
    ):
        return torch.mm(head.weight, x.t()).t()
    return head(x)


def _scatter(x: torch.Tensor, shape: tuple[int, int, torch.Tensor]) -> torch.Tensor:
    """Packed [T, heads, 1, d] → the slot layout [slots, heads, W, d] (zero at padding)."""
    slots, w, at = shape
    out = x.new_zeros((slots * w, x.shape[1], x.shape[-1]))
    out[at] = x[:, :, 0]
    return out.view(slots, w, x.shape[1], x.shape[-1]).transpose(1, 2)
