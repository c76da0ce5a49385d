"""How one micro-batch's sequences are laid out for the decoder, and which layout is cheapest.

Three layouts, each a class with `build` (token ids → `PackedInputs`) and `cost` (an estimate of
the decoder's work from the shapes alone), in one table, `LAYOUTS`:

- `padded`: one right-padded row per sequence, a `[rows, width]` padding mask;
- `packed`: every sequence in one row, `position_ids` restarting at 0, no mask — transformers
  builds a block-diagonal causal mask from the positions (SDPA/eager: dense over the whole
  row, quadratic in the micro-batch's total length) or runs varlen kernels (flash-attention 2).
  Models whose attention ignores the positions (OPT, Falcon under SDPA/eager) would mix the
  sequences: a probe against `padded` (`packed_unsupported`) keeps `packed` from them;
- `shared_prompt`: sequences whose prompt (`tokens[: len - response_len]`) is identical become
  ONE row `[prompt, resp_1, ..., resp_k]`, positions `0..P-1` for the prompt and `P..P+R_i-1`
  for each response, with a 4D mask: the prompt is causal, each response attends the prompt
  and itself causally, never another response. In GRPO the n samples of a group share the
  prompt, which is then computed once instead of n times (forward and backward). Rows are
  right-padded to the longest; a padding token attends only itself (no NaN). The mask travels
  as bool `[rows, 1, width, width]` (True = attend) and `PolicyLogprobs` turns it into the
  additive float mask SDPA and eager both take (transformers passes a 4D mask through as-is).
  Not for flash-attention 2 (no custom masks), nor for models whose attention is not plain
  full causal attention (sliding windows, recurrent/SSM layers): `shared_prompt_unsupported`.
  On the pieces attention the rows may also go flat, one after another in one unpadded row
  (`SharedPromptLayout(flat=True)`): the linear layers then see no padding.

`LayoutChooser` (`verst.trainer.train.layout_choice`) picks one layout per micro-batch: a fixed
one, or with `auto` the cheapest by `cost`. The estimate is per decoder layer (every layer is alike): linear work ∝ tokens processed
(padding included) × the layer's weights, attention ∝ Σ over rows of the pairs of positions it
scores × the attention width — dense `width²` for SDPA/eager with a mask, half that when
transformers can drop the mask (padded rows of equal length: causal kernel), `Σ len²/2` for
flash-attention's varlen kernels, and for `shared_prompt` on the pieces attention
(`verst.trainer.train.pieces`) the pairs of its pieces. The LM head and loss are the same for every layout
(only response positions reach them) and are left out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import Any, ClassVar, Protocol

import torch

from verst.trainer.train.pieces import ATTENTION_NAME as PIECES_ATTENTION
from verst.trainer.train.pieces import MIN_SAVED_MACS, RowPieces, pieces_pairs, worth_pieces

LAYOUT_NAMES = ("padded", "packed", "shared_prompt")
Seqs = Sequence[Sequence[int]]
"""Token ids of several sequences."""
Groups = Sequence[Sequence[int]] | None
"""Prompt groups (positions sharing a prompt), when the caller has them; None = compute."""
"""The concrete layouts; `train.layout` also takes 'auto'."""


@dataclass
class PackedInputs:
    """One micro-batch laid out for the decoder, plus where the response predictions sit."""

    input_ids: torch.Tensor  # [rows, width]
    """Token ids (one packed row, right-padded rows, or one row per shared prompt)."""
    position_ids: torch.Tensor  # [rows, width]
    """Positions of each token within its own sequence."""
    attention_mask: torch.Tensor | None  # [rows, width] or [rows, 1, width, width]
    """Padded: 1 = real token (long `[rows, width]`). Shared prompt: bool `[rows, 1, width, width]`,
    True where a query (dim 2) may attend a key (dim 3). None when packed."""
    gather_index: torch.Tensor  # [num_response_tokens]
    """Flat indices into `rows * width` of the hidden states that predict response tokens."""
    target_ids: torch.Tensor  # [num_response_tokens]
    """The response tokens those positions predict."""
    response_lengths: list[int]
    """Response length of each sequence, in order (to unflatten the result)."""
    layout: str = "padded"
    """The layout's name (one of `LAYOUT_NAMES`)."""
    vision: Any = None
    """`verst.trainer.train.vision.VisionBatch` when the sequences hold images (None: text only)."""
    pieces: RowPieces | None = None
    """Shared prompt: where each row's prompt and responses sit, for `pieces_sdpa` (None otherwise)."""


# ---------------------------------------------------------------- shapes and cost


@dataclass(frozen=True, slots=True)
class DecoderShape:
    """What the cost estimate needs of a decoder layer."""

    layer_params: int
    """Weights of one layer's linear maps (multiply-adds per token)."""
    attn_width: int
    """heads × head_dim of the queries (multiply-adds per scored pair, for QKᵀ and for AV each)."""

    @classmethod
    def from_config(cls, config: Any) -> DecoderShape:
        """From a Hugging Face config (its text config for multimodal models)."""
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        h = int(cfg.hidden_size)
        heads = int(getattr(cfg, "num_attention_heads", None) or max(1, h // 64))
        head_dim = int(getattr(cfg, "head_dim", None) or h // heads)
        kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
        inter = int(getattr(cfg, "intermediate_size", None) or 4 * h)
        attn = h * heads * head_dim * 2 + h * kv * head_dim * 2  # q, o; k, v
        return cls(layer_params=attn + 3 * h * inter, attn_width=heads * head_dim)


def prompt_groups(tokens: Seqs, response_lengths: Sequence[int]) -> list[list[int]]:
    """Indices of the sequences, grouped by identical prompt, in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (seq, r) in enumerate(zip(tokens, response_lengths, strict=True)):
        groups.setdefault(tuple(seq[: len(seq) - r]), []).append(i)
    return list(groups.values())


def prompt_keys(tokens: Seqs, response_lengths: Sequence[int]) -> list[int]:
    """A group id per sequence: equal ids = identical prompts (for `batch.micro_batches`)."""
    keys = [0] * len(tokens)
    for gid, members in enumerate(prompt_groups(tokens, response_lengths)):
        for i in members:
            keys[i] = gid
    return keys


def _check(tokens: Seqs, response_lengths: Sequence[int]) -> None:
    if len(tokens) != len(response_lengths):
        raise ValueError(f"{len(tokens)} sequences but {len(response_lengths)} response lengths")
    if any(r > 0 and r >= len(t) for t, r in zip(tokens, response_lengths, strict=True)):
        raise ValueError("every sequence with a response needs at least one prompt token before it")


def _cost(shape: DecoderShape, tokens: int, dense_pairs: float) -> float:
    """Multiply-adds of one layer's forward: linear maps + QKᵀ and AV over the scored pairs."""
    return float(tokens) * shape.layer_params + 2.0 * dense_pairs * shape.attn_width


class Layout(Protocol):
    """A way to lay out a micro-batch; `cost` compares layouts (same units across them)."""

    name: ClassVar[str]

    def build(
        self, tokens: Seqs, response_lengths: Sequence[int], *, pad_id: int = 0, groups: Groups = None
    ) -> PackedInputs: ...

    def cost(
        self,
        tokens: Seqs,
        response_lengths: Sequence[int],
        shape: DecoderShape,
        attn: str,
        groups: Groups = None,
    ) -> float: ...

    def width(self, tokens: Seqs, response_lengths: Sequence[int], groups: Groups = None) -> int:
        """The widest row this layout makes of these sequences (the columns attention sees)."""
        ...


class PaddedLayout:
    """One right-padded row per sequence."""

    name: ClassVar[str] = "padded"

    def build(
        self, tokens: Seqs, response_lengths: Sequence[int], *, pad_id: int = 0, groups: Groups = None
    ) -> PackedInputs:
        _check(tokens, response_lengths)
        width = max(len(t) for t in tokens)
        padded, lengths, gather, targets = [], [], [], []
        for row, (seq, r) in enumerate(zip(tokens, response_lengths, strict=True)):
            n = len(seq)
            padded.append([*seq, *([pad_id] * (width - n))])
            lengths.append(n)
            gather.extend(range(row * width + n - r - 1, row * width + n - 1))
            targets.extend(seq[n - r :])
        cols = torch.arange(width)[None, :]  # [1, width]
        mask = (cols < torch.tensor(lengths)[:, None]).long()  # [rows, width]
        return PackedInputs(
            input_ids=torch.tensor(padded, dtype=torch.long),
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            attention_mask=mask,
            gather_index=torch.tensor(gather, dtype=torch.long),
            target_ids=torch.tensor(targets, dtype=torch.long),
            response_lengths=list(response_lengths),
            layout=self.name,
        )

    def cost(
        self,
        tokens: Seqs,
        response_lengths: Sequence[int],
        shape: DecoderShape,
        attn: str,
        groups: Groups = None,
    ) -> float:
        lengths = [len(t) for t in tokens]
        width = max(lengths)
        if attn == "flash_attention_2":  # unpadded to varlen inside transformers; causal
            pairs = sum(n * n for n in lengths) / 2
        elif min(lengths) == width:  # no padding: transformers drops the mask, SDPA runs causal
            pairs = len(lengths) * width * width / 2
        else:
            pairs = len(lengths) * width * width
        return _cost(shape, len(lengths) * width, pairs)

    def width(self, tokens: Seqs, response_lengths: Sequence[int], groups: Groups = None) -> int:
        return max(len(t) for t in tokens)


class PackedLayout:
    """Every sequence in one row, positions restarting at 0, no mask (see module doc)."""

    name: ClassVar[str] = "packed"

    def build(
        self, tokens: Seqs, response_lengths: Sequence[int], *, pad_id: int = 0, groups: Groups = None
    ) -> PackedInputs:
        _check(tokens, response_lengths)
        ids, pos, gather, targets, offset = [], [], [], [], 0
        for seq, r in zip(tokens, response_lengths, strict=True):
            n = len(seq)
            ids.extend(seq)
            pos.extend(range(n))
            gather.extend(range(offset + n - r - 1, offset + n - 1))
            targets.extend(seq[n - r :])
            offset += n
        return PackedInputs(
            input_ids=torch.tensor([ids], dtype=torch.long),
            position_ids=torch.tensor([pos], dtype=torch.long),
            attention_mask=None,
            gather_index=torch.tensor(gather, dtype=torch.long),
            target_ids=torch.tensor(targets, dtype=torch.long),
            response_lengths=list(response_lengths),
            layout=self.name,
        )

    def cost(
        self,
        tokens: Seqs,
        response_lengths: Sequence[int],
        shape: DecoderShape,
        attn: str,
        groups: Groups = None,
    ) -> float:
        lengths = [len(t) for t in tokens]
        total = sum(lengths)
        pairs = sum(n * n for n in lengths) / 2 if attn == "flash_attention_2" else total * total
        return _cost(shape, total, pairs)

    def width(self, tokens: Seqs, response_lengths: Sequence[int], groups: Groups = None) -> int:
        return sum(len(t) for t in tokens)


@dataclass(frozen=True, slots=True)
class SharedPromptLayout:
    """One row per distinct prompt: `[prompt, resp_1, ..., resp_k]` with a 4D mask (module doc).

    `per_row` caps the responses in one row: a larger group is split into rows of at most that
    many (balanced), each with its own copy of the prompt — fewer tokens than padding, less
    attention than one long row (the chooser weighs the two).

    `flat` puts those rows one after another in ONE row without padding (`[1, Σ widths]`), for a
    model on the pieces attention (`verst.trainer.train.pieces`), which reads each group's
    prompt and responses out of it: the linear layers then see the real tokens only, where the
    padded rows feed every row's padding up to the longest (13–29% of the tiny benchmark's
    tokens). No dense mask can stand in for the pieces there (it would be `[Σ widths]²`), so the
    inputs carry a `[1, 1, 1, 1]` placeholder that transformers passes through untouched, and
    `pieces_sdpa` refuses to run such a row any other way."""

    name: ClassVar[str] = "shared_prompt"
    per_row: int | None = None
    """Most responses in one row (None = the whole group)."""
    flat: bool = False
    """Every row in one unpadded row, for the pieces attention only."""

    def rows(self, tokens: Seqs, response_lengths: Sequence[int], groups: Groups = None) -> list[list[int]]:
        """The sequences of each row: `groups` (default: `prompt_groups`), split by `per_row`."""
        out = []
        for g in prompt_groups(tokens, response_lengths) if groups is None else map(list, groups):
            parts = 1 if self.per_row is None else -(-len(g) // self.per_row)
            size, extra, start = len(g) // parts, len(g) % parts, 0
            for p in range(parts):
                end = start + size + (1 if p < extra else 0)
                out.append(g[start:end])
                start = end
        return out

    def row_widths(self, tokens: Seqs, response_lengths: Sequence[int], rows: list[list[int]]) -> list[int]:
        """Length of each of `rows` (prompt + its responses)."""
        return [
            len(tokens[g[0]]) - response_lengths[g[0]] + sum(response_lengths[i] for i in g) for g in rows
        ]

    def width(self, tokens: Seqs, response_lengths: Sequence[int], groups: Groups = None) -> int:
        """The longest row (flat: the one row of them all)."""
        widths = self.row_widths(tokens, response_lengths, self.rows(tokens, response_lengths, groups))
        return sum(widths) if self.flat else max(widths)

    def build(
        self, tokens: Seqs, response_lengths: Sequence[int], *, pad_id: int = 0, groups: Groups = None
    ) -> PackedInputs:
        _check(tokens, response_lengths)
        groups = self.rows(tokens, response_lengths, groups)
        widths = self.row_widths(tokens, response_lengths, groups)
        width = sum(widths) if self.flat else max(widths)
        offsets = [0, *accumulate(widths[:-1])] if self.flat else None
        ids, pos = [], []  # per row, as lists (one tensor each at the end)
        first: dict[int, int] = {}  # sequence -> flat index predicting its first response token
        starts: dict[int, int] = {}  # sequence -> flat index of its first response token
        prompts, parts = [], []  # per row: prompt length; (start column, length) of each response
        for row, g in enumerate(groups):
            at = offsets[row] if offsets is not None else row * width  # the row's first flat index
            p = len(tokens[g[0]]) - response_lengths[g[0]]
            row_ids, row_pos = list(tokens[g[0]][:p]), list(range(p))
            prompts.append(p)
            parts.append([])
            for i in g:
                r, col = response_lengths[i], len(row_ids)
                row_ids.extend(tokens[i][p:])
                row_pos.extend(range(p, p + r))
                first[i], starts[i] = at + p - 1, at + col
                parts[-1].append((col, r))
            pad = 0 if self.flat else width - len(row_ids)
            ids.append(row_ids + [pad_id] * pad)
            pos.append(row_pos + [0] * pad)
        gather, targets = [], []
        for i, (seq, r) in enumerate(zip(tokens, response_lengths, strict=True)):
            if r:
                gather.append(first[i])  # the last prompt position, shared by the group
                gather.extend(range(starts[i], starts[i] + r - 1))
                targets.extend(seq[len(seq) - r :])
        if self.flat:  # one row; the pieces attention needs no mask (a placeholder: class doc)
            ids, pos = [list(chain.from_iterable(ids))], [list(chain.from_iterable(pos))]
            mask = torch.ones(1, 1, 1, 1, dtype=torch.bool)
        else:
            mask = _shared_prompt_mask(prompts, parts, width)[:, None]
        return PackedInputs(
            input_ids=torch.tensor(ids, dtype=torch.long),
            position_ids=torch.tensor(pos, dtype=torch.long),
            attention_mask=mask,
            gather_index=torch.tensor(gather, dtype=torch.long),
            target_ids=torch.tensor(targets, dtype=torch.long),
            response_lengths=list(response_lengths),
            layout=self.name,
            pieces=RowPieces.build(prompts, parts, width, offsets),
        )

    def cost(
        self,
        tokens: Seqs,
        response_lengths: Sequence[int],
        shape: DecoderShape,
        attn: str,
        groups: Groups = None,
    ) -> float:
        """Flat rows are charged `MIN_SAVED_MACS` for the pieces' gathers and scatters (`pieces`)."""
        rows = self.rows(tokens, response_lengths, groups)
        widths = self.row_widths(tokens, response_lengths, rows)
        width = max(widths)
        dense = len(widths) * width * width  # SDPA/eager over the 4D mask
        if attn == PIECES_ATTENTION:
            longest_prompt = max(len(tokens[g[0]]) - response_lengths[g[0]] for g in rows)
            longest_response = max(response_lengths[i] for g in rows for i in g)
            pairs = pieces_pairs(len(rows), longest_prompt, max(map(len, rows)), longest_response)
            if self.flat:
                return _cost(shape, sum(widths), pairs) + MIN_SAVED_MACS
            dense = pairs if worth_pieces(dense, pairs, shape.attn_width) else dense
        elif self.flat:
            return math.inf  # only the pieces attention can run it
        return _cost(shape, len(widths) * width, dense)


def _shared_prompt_mask(
    prompts: Sequence[int], parts: Sequence[Sequence[tuple[int, int]]], width: int
) -> torch.Tensor:
    """The shared-prompt rows' bool mask `[rows, width, width]` from each row's prompt length and
    its responses' `(start column, length)`: causal; the prompt sees itself, a response the
    prompt and itself, padding only itself."""
    seg = []  # per position: 0 = prompt, k = k-th response, -(col + 1) = padding (unique)
    for p, row in zip(prompts, parts, strict=True):
        used = p + sum(r for _, r in row)
        seg.append([0] * p + [k for k, (_, r) in enumerate(row, start=1) for _ in range(r)])
        seg[-1] += range(-used - 1, -width - 1, -1)
    segs = torch.tensor(seg, dtype=torch.long)  # [rows, width]
    q, k = segs[:, :, None], segs[:, None, :]  # [rows, width, 1], [rows, 1, width]
    causal = torch.ones(width, width, dtype=torch.bool).tril()  # [width, width]
    return causal & (((k == 0) & (q >= 0)) | (q == k))


LAYOUTS: dict[str, Layout] = {c.name: c() for c in (PaddedLayout, PackedLayout, SharedPromptLayout)}
"""Layout name → layout (a new layout is a class plus an entry here)."""


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool 4D mask (True = attend) → `0` / `finfo(dtype).min`, what SDPA and eager add to scores."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, torch.finfo(dtype).min
    )
