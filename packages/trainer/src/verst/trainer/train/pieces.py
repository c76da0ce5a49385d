"""Attention over a shared-prompt row's pieces, without the dense whole-row mask.

In the `shared_prompt` layout (`verst.trainer.train.layout`) a row is `[prompt, resp_1, ...,
resp_k]`: the prompt attends causally to itself, each response to the whole prompt and causally
to itself, never to another response. Through SDPA with the layout's 4D mask every query of the
row scores every key (W² pairs for a row of W = P + Σ R_i positions), and transformers repeats
each KV head once per query head (grouped-query attention) because a mask is given.

`pieces_sdpa` computes the same attention over the pairs that structure needs, from `RowPieces`
(index grids the layout builds):
- the prompts of all rows in one SDPA call, `[rows, L]` (prompts right-padded to the longest,
  L), causal;
- every response in one SDPA call, against `[its prompt's keys ; its own keys]` (`[rows · k,
  L + R]`, responses right-padded to the longest, R): the prompt's padding masked, causal in
  its own part.

The query heads that share a KV head are folded into the query axis, so keys and values are
never repeated per query head. The results are scattered back to the row's positions (padding
positions get zeros: nothing reads them). Scored pairs per row: L² + k · R · (L + R) instead of
W² — at the 31.5M benchmark's shapes (P 64–256, 8 responses of 128) about 5× fewer.

`use_pieces_attention(model)` registers `pieces_sdpa` under `ATTENTION_NAME` (with transformers'
SDPA mask function, so every other layout builds the masks SDPA would) and switches the model to
it. Without a `shared_pieces` keyword — padded and packed micro-batches, or rows too small to
gain — the call is SDPA over the mask transformers built, with the query heads folded onto their
KV head as the embedded engine does (`grouped_sdpa`: the same attention without repeating the
keys and values). `PolicyLogprobs` passes the
pieces of a shared-prompt micro-batch as `shared_pieces=` through the decoder's forward, which
hands its keyword arguments to every attention call; it still passes the 4D mask, so a model
that is not on this attention computes the same function the slow way.

Flat pieces (`RowPieces.flat`, from `SharedPromptLayout(flat=True)`) index every group inside ONE
unpadded row: their `rows` are the groups, the query's batch is 1. No mask can stand in for
them, so `pieces_sdpa` refuses to run them any other way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

from verst.rollout.engines.embedded.attention import grouped_sdpa

ATTENTION_NAME = "verst_shared_prompt_sdpa"
"""The name `pieces_sdpa` (and transformers' SDPA mask function) is registered under."""

MIN_SAVED_MACS = 1 << 24
"""Multiply-adds per layer (scored pairs saved × attention width) the pieces must save over the
dense mask to be worth their extra operations (gathers, two attention calls, a scatter). Measured
on the 2-core CPU box: the tiny benchmark's rows (~3.4M saved) train 15% slower on the pieces,
the 31.5M benchmark's (~415M saved) 10–15% faster."""


def pieces_pairs(rows: int, longest_prompt: int, per_row: int, longest_response: int) -> int:
    """Query-key pairs the pieces score per head for `rows` rows of the grid's sizes."""
    return rows * (longest_prompt**2 + per_row * longest_response * (longest_prompt + longest_response))


def worth_pieces(dense_pairs: int, pairs: int, attn_width: int, min_saved: int = MIN_SAVED_MACS) -> bool:
    """Whether scoring `pairs` instead of `dense_pairs` saves at least `min_saved` multiply-adds a layer."""
    return (dense_pairs - pairs) * attn_width >= min_saved


@dataclass(frozen=True)
class RowPieces:
    """Where the prompt and response positions of a shared-prompt micro-batch sit (flat
    indices into `rows * width`; grid padding points at index 0 and is masked)."""

    prompt_index: torch.Tensor  # [rows, L] long
    prompt_valid: torch.Tensor  # [rows, L] bool
    response_index: torch.Tensor  # [rows, K, R] long
    response_valid: torch.Tensor  # [rows, K, R] bool
    destination: torch.Tensor  # [real positions] long: where cat(prompt[valid], response[valid]) go
    width: int
    """Positions per row of the layout (W)."""
    flat: bool = False
    """Every group in ONE unpadded row (`SharedPromptLayout(flat=True)`): no dense mask can stand
    in, so the pieces attention is the only way to run it."""

    @classmethod
    def build(
        cls,
        prompts: Sequence[int],
        responses: Sequence[Sequence[tuple[int, int]]],
        width: int,
        offsets: Sequence[int] | None = None,
    ) -> RowPieces:
        """`prompts[row]`: the row's prompt length (it starts at column 0); `responses[row]`:
        `(start column, length)` of each response in the row. `offsets[row]`: where the row starts
        in the flat positions (default `row * width`); given, the pieces are `flat` (one row of
        `width` positions holding every group)."""
        rows = len(prompts)
        big_l = max(prompts)
        big_k = max(len(r) for r in responses)
        big_r = max((n for r in responses for _, n in r), default=1) or 1
        cols = torch.arange(big_l)
        prompt_len = torch.tensor(list(prompts))[:, None]  # [rows, 1]
        prompt_valid = cols[None, :] < prompt_len  # [rows, L]
        starts_at = torch.arange(rows) * width if offsets is None else torch.tensor(list(offsets))
        base = starts_at[:, None]  # [rows, 1]
        prompt_index = torch.where(prompt_valid, base + cols[None, :], 0)
        fill = [(0, 0)] * big_k
        grid = torch.tensor([list(parts) + fill[len(parts) :] for parts in responses], dtype=torch.long)
        starts, lengths = grid[..., 0], grid[..., 1]  # [rows, K] each
        offs = torch.arange(big_r)
        response_valid = offs[None, None, :] < lengths[:, :, None]  # [rows, K, R]
        response_index = torch.where(response_valid, base[:, :, None] + starts[:, :, None] + offs, 0)
        destination = torch.cat([prompt_index[prompt_valid], response_index[response_valid]])
        return cls(
            prompt_index,
            prompt_valid,
            response_index,
            response_valid,
            destination,
            width,
            offsets is not None,
        )

    def to(self, device: torch.device | str) -> RowPieces:
        """The same pieces on `device`."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return RowPieces(**moved, width=self.width, flat=self.flat)

    def pairs(self) -> int:
        """Query-key pairs `pieces_sdpa` scores per head (what the layout's cost counts)."""
        rows, big_l = self.prompt_index.shape
        _, big_k, big_r = self.response_index.shape
        return pieces_pairs(rows, big_l, big_k, big_r)

    def worth_it(self, attn_width: int, min_saved: int = MIN_SAVED_MACS) -> bool:
        """Whether these rows save enough over the dense mask (`worth_pieces`); flat pieces always."""
        return self.flat or worth_pieces(
            self.prompt_index.shape[0] * self.width**2, self.pairs(), attn_width, min_saved
        )


def _folded_sdpa(
    q: torch.Tensor,  # [b, kv, rep, t, d]
    k: torch.Tensor,  # [b, kv, s, d]
    v: torch.Tensor,  # [b, kv, s, d]
    mask: torch.Tensor,  # [b or 1, 1, t, s] bool, True = attend
    scaling: float | None,
) -> torch.Tensor:
    """SDPA with the `rep` query heads of each KV head folded into the query axis → [b, kv, rep, t, d]."""
    b, kv, rep, t, d = q.shape
    folded = (
        mask[:, :, None]
        .expand(mask.shape[0], 1, rep, t, mask.shape[-1])
        .reshape(mask.shape[0], 1, rep * t, -1)
    )
    out = F.scaled_dot_product_attention(q.reshape(b, kv, rep * t, d), k, v, attn_mask=folded, scale=scaling)
    return out.view(b, kv, rep, t, d)


def pieces_attention(
    query: torch.Tensor,  # [rows, heads, W, d]
    key: torch.Tensor,  # [rows, kv_heads, W, d]
    value: torch.Tensor,  # [rows, kv_heads, W, d]
    pieces: RowPieces,
    scaling: float | None = None,
) -> torch.Tensor:
    """The shared-prompt attention over its pieces (module doc) → `[b, W, heads, d]` (b = rows of
    the layout; 1 when the pieces are `flat`, their `rows` then being the groups in that row)."""
    b, heads, width, d = query.shape
    kv = key.shape[1]
    rep = heads // kv
    flat_q = query.transpose(1, 2).reshape(b * width, heads, d)
    flat_k = key.transpose(1, 2).reshape(b * width, kv, d)
    flat_v = value.transpose(1, 2).reshape(b * width, kv, d)
    p_idx, p_ok = pieces.prompt_index, pieces.prompt_valid  # [rows, L]
    rows = p_idx.shape[0]
    r_idx, r_ok = pieces.response_index, pieces.response_valid  # [rows, K, R]
    big_l, (big_k, big_r) = p_idx.shape[1], r_idx.shape[1:]
    kp = flat_k[p_idx].permute(0, 2, 1, 3)  # [rows, kv, L, d]
    vp = flat_v[p_idx].permute(0, 2, 1, 3)
    qp = flat_q[p_idx].view(rows, big_l, kv, rep, d).permute(0, 2, 3, 1, 4)  # [rows, kv, rep, L, d]
    causal_l = torch.ones(big_l, big_l, dtype=torch.bool, device=query.device).tril()
    po = _folded_sdpa(qp, kp, vp, causal_l[None, None], scaling)  # [rows, kv, rep, L, d]
    po = po.permute(0, 3, 1, 2, 4).reshape(rows, big_l, heads, d)[p_ok]  # [valid prompt, heads, d]
    qr = flat_q[r_idx].view(rows * big_k, big_r, kv, rep, d).permute(0, 2, 3, 1, 4)  # [rows·K, kv, rep, R, d]
    own_k = flat_k[r_idx].view(rows * big_k, big_r, kv, d).transpose(1, 2)  # [rows·K, kv, R, d]
    own_v = flat_v[r_idx].view(rows * big_k, big_r, kv, d).transpose(1, 2)
    both_k = torch.cat(
        [kp[:, None].expand(rows, big_k, kv, big_l, d).reshape(rows * big_k, kv, big_l, d), own_k], 2
    )
    both_v = torch.cat(
        [vp[:, None].expand(rows, big_k, kv, big_l, d).reshape(rows * big_k, kv, big_l, d), own_v], 2
    )
    causal_r = torch.ones(big_r, big_r, dtype=torch.bool, device=query.device).tril()  # [R, R]
    see_prompt = p_ok[:, None, None, :].expand(rows, big_k, big_r, big_l)  # [rows, K, R, L]
    see_own = causal_r.expand(rows, big_k, big_r, big_r)
    mask = torch.cat([see_prompt, see_own], -1).reshape(rows * big_k, 1, big_r, big_l + big_r)
    ro = _folded_sdpa(qr, both_k, both_v, mask, scaling)  # [rows·K, kv, rep, R, d]
    ro = ro.permute(0, 3, 1, 2, 4).reshape(rows, big_k, big_r, heads, d)[r_ok]  # [valid responses, heads, d]
    out = query.new_zeros(b * width, heads, d).index_copy(0, pieces.destination, torch.cat([po, ro]))
    return out.view(b, width, heads, d)


def pieces_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,  # [b, heads, t, d]
    key: torch.Tensor,  # [b, kv_heads, L, d]
    value: torch.Tensor,  # [b, kv_heads, L, d]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    shared_pieces: RowPieces | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; `pieces_attention` when `shared_pieces` is
    given (and no dropout), else SDPA with the query heads folded onto their KV head
    (`grouped_sdpa`, the embedded engine's: transformers' SDPA where folding does not apply)."""
    if shared_pieces is None or dropout > 0.0 or query.shape[2] != shared_pieces.width:
        if shared_pieces is not None and shared_pieces.flat:
            raise ValueError(
                f"a flat shared-prompt row runs on the pieces attention only (dropout {dropout}, "
                f"{query.shape[2]} positions for pieces of {shared_pieces.width})"
            )
        return grouped_sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    return pieces_attention(query, key, value, shared_pieces, scaling=scaling), None


def use_pieces_attention(model: Any) -> bool:
    """Switch `model` (a transformers model on SDPA) to `pieces_sdpa`; whether it switched.

    Models on another attention implementation are left as they are (shared-prompt rows then
    run through their 4D mask)."""
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", ATTENTION_NAME):
        return False
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, pieces_sdpa)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    model.set_attn_implementation(ATTENTION_NAME)
    return True


def uses_pieces_attention(model: Any) -> bool:
    """Whether `model` runs `pieces_sdpa` (so a forward may pass `shared_pieces=`)."""
    return getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME
