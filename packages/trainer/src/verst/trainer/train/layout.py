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

`LayoutChooser` picks one layout per micro-batch: a fixed one, or with `auto` the cheapest by
`cost`. The estimate is per decoder layer (every layer is alike): linear work ∝ tokens processed
(padding included) × the layer's weights, attention ∝ Σ over rows of the pairs of positions it
scores × the attention width — dense `width²` for SDPA/eager with a mask, half that when
transformers can drop the mask (padded rows of equal length: causal kernel), `Σ len²/2` for
flash-attention's varlen kernels. The LM head and loss are the same for every layout
(only response positions reach them) and are left out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

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


@dataclass(frozen=True, slots=True)
class SharedPromptLayout:
    """One row per distinct prompt: `[prompt, resp_1, ..., resp_k]` with a 4D mask (module doc).

    `per_row` caps the responses in one row: a larger group is split into rows of at most that
    many (balanced), each with its own copy of the prompt — fewer tokens than padding, less
    attention than one long row (the chooser weighs the two)."""

    name: ClassVar[str] = "shared_prompt"
    per_row: int | None = None
    """Most responses in one row (None = the whole group)."""

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

    def build(
        self, tokens: Seqs, response_lengths: Sequence[int], *, pad_id: int = 0, groups: Groups = None
    ) -> PackedInputs:
        _check(tokens, response_lengths)
        groups = self.rows(tokens, response_lengths, groups)
        width = max(self.row_widths(tokens, response_lengths, groups))
        ids = torch.full((len(groups), width), pad_id, dtype=torch.long)  # [rows, width]
        pos = torch.zeros((len(groups), width), dtype=torch.long)  # [rows, width]
        # segment of each position: 0 = prompt, k = k-th response, -(col + 1) = padding (unique)
        seg = -(torch.arange(width, dtype=torch.long) + 1).repeat(len(groups), 1)  # [rows, width]
        first: dict[int, int] = {}  # sequence -> flat index predicting its first response token
        starts: dict[int, int] = {}  # sequence -> flat index of its first response token
        for row, g in enumerate(groups):
            p = len(tokens[g[0]]) - response_lengths[g[0]]
            ids[row, :p] = torch.tensor(list(tokens[g[0]][:p]), dtype=torch.long)
            pos[row, :p] = torch.arange(p)
            seg[row, :p] = 0
            col = p
            for k, i in enumerate(g, start=1):
                r = response_lengths[i]
                ids[row, col : col + r] = torch.tensor(list(tokens[i][p:]), dtype=torch.long)
                pos[row, col : col + r] = torch.arange(p, p + r)
                seg[row, col : col + r] = k
                first[i], starts[i] = row * width + p - 1, row * width + col
                col += r
        gather, targets = [], []
        for i, (seq, r) in enumerate(zip(tokens, response_lengths, strict=True)):
            if r:
                gather.append(first[i])  # the last prompt position, shared by the group
                gather.extend(range(starts[i], starts[i] + r - 1))
                targets.extend(seq[len(seq) - r :])
        q, k = seg[:, :, None], seg[:, None, :]  # [rows, width, 1], [rows, 1, width]
        causal = torch.ones(width, width, dtype=torch.bool).tril()  # [width, width]
        mask = causal & (((k == 0) & (q >= 0)) | (q == k))  # [rows, width, width]
        return PackedInputs(
            input_ids=ids,
            position_ids=pos,
            attention_mask=mask[:, None],
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
        widths = self.row_widths(tokens, response_lengths, self.rows(tokens, response_lengths, groups))
        width = max(widths)
        return _cost(shape, len(widths) * width, len(widths) * width * width)


LAYOUTS: dict[str, Layout] = {c.name: c() for c in (PaddedLayout, PackedLayout, SharedPromptLayout)}
"""Layout name → layout (a new layout is a class plus an entry here)."""


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool 4D mask (True = attend) → `0` / `finfo(dtype).min`, what SDPA and eager add to scores."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, torch.finfo(dtype).min
    )


# ---------------------------------------------------------------- which models can share prompts


def shared_prompt_unsupported(
    config: Any, probe: Callable[[PackedInputs], torch.Tensor] | None = None, *, tolerance: float = 1e-3
) -> str | None:
    """Why `shared_prompt` would give wrong log-probs for this model, or None when it is safe.

    The config must describe plain full causal attention in every layer (no sliding window, no
    chunked attention, no `layer_types` other than full attention). `probe(inputs)` — the
    model's response log-probs of a `PackedInputs` — is then run on a tiny group in both the
    padded and the shared layout: a model that mixes tokens outside attention (recurrent or
    SSM layers) or ignores a custom 4D mask disagrees by more than `tolerance` and is refused.
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = set(getattr(cfg, "layer_types", None) or ())
    if kinds - {"full_attention"}:
        return f"its layers are not all full attention (layer_types {sorted(kinds)})"
    window = getattr(cfg, "sliding_window", None)
    if window is not None and getattr(cfg, "use_sliding_window", True):
        return f"it uses sliding-window attention (sliding_window={window})"
    if getattr(cfg, "attention_chunk_size", None) is not None:
        return "it uses chunked attention (attention_chunk_size)"
    if probe is None:
        return None
    vocab = int(getattr(cfg, "vocab_size", 64) or 64)
    ids = [(7 * j + 3) % min(vocab, 97) for j in range(13)]
    tokens = [ids[:9], ids[:5] + ids[9:13], ids[:5] + ids[2:4]]
    resp = [4, 4, 2]
    lp_padded = probe(LAYOUTS["padded"].build(tokens, resp)).float()
    lp_shared = probe(LAYOUTS["shared_prompt"].build(tokens, resp)).float()
    diff = float((lp_padded - lp_shared).abs().max())
    if not math.isfinite(diff) or diff > tolerance:
        return (
            f"a probe's log-probs differ between the padded and the shared-prompt layout (max {diff:.3g}): "
            "the model mixes tokens outside its attention mask"
        )
    return None


def packed_unsupported(
    probe: Callable[[PackedInputs], torch.Tensor] | None, *, vocab: int = 64, tolerance: float = 1e-3
) -> str | None:
    """Why `packed` would give wrong log-probs for this model, or None when it is exact (or
    there is no `probe` to tell).

    `packed` passes no mask and trusts the model to find sequence boundaries from the restarting
    position ids; models whose attention ignores them (OPT, Falcon, ... under SDPA/eager) let
    every sequence attend the ones before it in the row. The probe runs three distinct sequences
    of uneven lengths in the padded and the packed layout and compares their log-probs.
    """
    if probe is None:
        return None
    ids = [(5 * j + 2) % min(vocab, 97) for j in range(13)]
    tokens = [ids[:9], ids[3:8], ids[1:12]]
    resp = [4, 2, 5]
    lp_padded = probe(LAYOUTS["padded"].build(tokens, resp)).float()
    lp_packed = probe(LAYOUTS["packed"].build(tokens, resp)).float()
    diff = float((lp_padded - lp_packed).abs().max())
    if not math.isfinite(diff) or diff > tolerance:
        return (
            f"a probe's log-probs differ between the padded and the packed layout (max {diff:.3g}): "
            "the model's attention does not separate packed sequences by their position ids"
        )
    return None


def _refuse(layout: str, reason: str) -> None:
    from verst.rollout.errors import ConfigError, Problem

    others = [n for n in ("auto", *LAYOUT_NAMES) if n != layout]
    raise ConfigError(
        [
            Problem(
                "train.layout",
                f"{layout!r} would not give this model's log-probs: {reason}",
                f"set train.layout to {', '.join(repr(n) for n in others[:-1])} or {others[-1]!r}",
            )
        ]
    )


# ---------------------------------------------------------------- the choice


@dataclass(frozen=True, slots=True)
class LayoutChooser:
    """Lays out each micro-batch in the requested layout, or ('auto') the cheapest candidate."""

    candidates: tuple[str, ...]
    """Layouts to choose from (one = fixed)."""
    shape: DecoderShape
    """The decoder's layer shape, for `cost`."""
    attn: str
    """The resolved attention implementation ('sdpa', 'eager', 'flash_attention_2')."""

    @classmethod
    def build(
        cls,
        requested: str,
        *,
        config: Any,
        attn: str,
        probe: Callable[[PackedInputs], torch.Tensor] | None = None,
        tolerance: float = 1e-3,
    ) -> LayoutChooser:
        """The chooser for `requested` ('auto' or a layout name) on a model with this config.

        'auto' chooses among padded, packed where it is exact (`packed_unsupported`: the probe
        compares it with padded), and shared_prompt where it is exact (not with flash-attention 2,
        see `shared_prompt_unsupported`); asking for packed or shared_prompt where it is not exact
        raises a `ConfigError` under `train.layout` naming the reason.
        """
        if requested != "auto" and requested not in LAYOUTS:
            raise ValueError(f"unknown layout {requested!r}; choose one of 'auto', {', '.join(LAYOUT_NAMES)}")
        shape = DecoderShape.from_config(config)
        reason = None
        if requested in ("auto", "shared_prompt"):
            if attn == "flash_attention_2":
                reason = "flash_attention_2 takes no custom attention mask"
            else:
                reason = shared_prompt_unsupported(config, probe, tolerance=tolerance)
        if requested == "shared_prompt" and reason is not None:
            _refuse("shared_prompt", reason)
        packed_reason = None
        if requested in ("auto", "packed"):
            cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
            vocab = int(getattr(cfg, "vocab_size", 64) or 64)
            packed_reason = packed_unsupported(probe, vocab=vocab, tolerance=tolerance)
        if requested == "packed" and packed_reason is not None:
            _refuse("packed", packed_reason)
        if requested != "auto":
            return cls((requested,), shape, attn)
        names = ("padded",) + (("packed",) if packed_reason is None else ())
        names += ("shared_prompt",) if reason is None else ()
        return cls(names, shape, attn)

    def pick(self, tokens: Seqs, response_lengths: Sequence[int], groups: Groups = None) -> Layout:
        """The cheapest candidate for these sequences (ties: the earlier candidate). Shared
        prompts also weigh splitting a group into rows of 2, 4, 8, ... responses. `groups`: the
        sequences' prompt groups when the caller has them (else computed here, once)."""
        options: list[Layout] = []
        for name in self.candidates:
            options.append(LAYOUTS[name])
            if name == "shared_prompt":
                if groups is None:
                    groups = prompt_groups(tokens, response_lengths)
                largest = max(map(len, groups))
                k = 2
                while k < largest:
                    options.append(SharedPromptLayout(per_row=k))
                    k *= 2
        if len(options) == 1:
            return options[0]
        costs = [o.cost(tokens, response_lengths, self.shape, self.attn, groups=groups) for o in options]
        return options[costs.index(min(costs))]

    def choose(self, tokens: Seqs, response_lengths: Sequence[int]) -> str:
        """The name of the layout `pick` takes."""
        return self.pick(tokens, response_lengths).name

    def lay_out(
        self, tokens: Seqs, response_lengths: Sequence[int], *, pad_id: int = 0, groups: Groups = None
    ) -> PackedInputs:
        """`tokens` in the chosen layout."""
        layout = self.pick(tokens, response_lengths, groups=groups)
        return layout.build(tokens, response_lengths, pad_id=pad_id, groups=groups)
