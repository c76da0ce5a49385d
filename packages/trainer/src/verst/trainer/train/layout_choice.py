"""Which micro-batch layout a model may use, and the choice of one per micro-batch.

`LayoutChooser.build` probes the model (`shared_prompt_unsupported`, `packed_unsupported`: the
same tiny sequences in the padded layout and in the candidate, compared) and keeps the layouts
that give its log-probs; `pick` then takes the cheapest by the layouts' `cost`
(`verst.trainer.train.layout`) for each micro-batch, or the one `train.layout` names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verst.trainer.train.layout import (
    LAYOUT_NAMES,
    LAYOUTS,
    DecoderShape,
    Groups,
    Layout,
    PackedInputs,
    Seqs,
    SharedPromptLayout,
    prompt_groups,
)
from verst.trainer.train.pieces import ATTENTION_NAME as PIECES_ATTENTION

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
    return _probe_disagrees(
        probe, "shared_prompt", tokens, resp, tolerance, "the model mixes tokens outside its attention mask"
    )


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
    why = "the model's attention does not separate packed sequences by their position ids"
    return _probe_disagrees(probe, "packed", tokens, resp, tolerance, why)


def _flat_ok(
    cfg: Any, attn: str, probe: Callable[[PackedInputs], torch.Tensor] | None, tolerance: float
) -> bool:
    """Whether shared prompts may go in one unpadded row (`cfg`: the text config): only the pieces
    attention runs it, and it has no dropout (`pieces_sdpa` refuses a flat row otherwise); a probe
    (three sequences, two sharing a prompt) must agree with the padded layout."""
    if attn != PIECES_ATTENTION or float(getattr(cfg, "attention_dropout", 0.0) or 0.0) > 0.0:
        return False
    if probe is None:
        return True
    vocab = int(getattr(cfg, "vocab_size", 64) or 64)
    ids = [(3 * j + 5) % min(vocab, 97) for j in range(13)]
    tokens = [ids[:9], ids[:5] + ids[9:13], ids[2:8]]
    why = "the model mixes tokens outside the pieces attention"
    return _probe_disagrees(probe, SharedPromptLayout(flat=True), tokens, [4, 4, 3], tolerance, why) is None


def _probe_disagrees(
    probe: Callable[[PackedInputs], torch.Tensor],
    layout: str | Layout,
    tokens: Seqs,
    resp: Sequence[int],
    tolerance: float,
    why: str,
) -> str | None:
    """The refusal when `probe`'s log-probs in `layout` (a name or a layout) differ from the
    padded layout's by more than `tolerance` (or are not finite), else None."""
    other = LAYOUTS[layout] if isinstance(layout, str) else layout
    lp_padded = probe(LAYOUTS["padded"].build(tokens, resp)).float()
    lp_other = probe(other.build(tokens, resp)).float()
    diff = float((lp_padded - lp_other).abs().max())
    if not math.isfinite(diff) or diff > tolerance:
        name = other.name.replace("_", "-")
        return f"a probe's log-probs differ between the padded and the {name} layout (max {diff:.3g}): {why}"
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
    """The resolved attention implementation ('sdpa', 'eager', 'flash_attention_2', or the pieces
    attention's name)."""
    flat: bool = False
    """Shared prompts may also go in one unpadded row (`SharedPromptLayout(flat=True)`): the model
    runs the pieces attention without dropout and a probe of that row agreed with padded."""
    max_width: int | None = None
    """`train.exact_on_policy`: when a packed or shared-prompt layout's rows are at most this wide
    (`exact_ops.KEY_BLOCK`: one block, attended as laid out), 'auto' chooses among those and
    padded only; wider rows of several sequences are gathered per sequence in the attention, which
    the cost does not see (measured: dearer than the narrow rows, cheaper than padding on the
    31.5M model, where no shared row fits in 64)."""

    @classmethod
    def build(
        cls,
        requested: str,
        *,
        config: Any,
        attn: str,
        probe: Callable[[PackedInputs], torch.Tensor] | None = None,
        tolerance: float = 1e-3,
        max_width: int | None = None,
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
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
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
            vocab = int(getattr(cfg, "vocab_size", 64) or 64)
            packed_reason = packed_unsupported(probe, vocab=vocab, tolerance=tolerance)
        if requested == "packed" and packed_reason is not None:
            _refuse("packed", packed_reason)
        shares = requested in ("auto", "shared_prompt") and reason is None
        flat = shares and _flat_ok(cfg, attn, probe, tolerance)
        if requested != "auto":
            return cls((requested,), shape, attn, flat)
        names = ("padded",) + (("packed",) if packed_reason is None else ())
        names += ("shared_prompt",) if reason is None else ()
        return cls(names, shape, attn, flat, max_width)

    def pick(self, tokens: Seqs, response_lengths: Sequence[int], groups: Groups = None) -> Layout:
        """The cheapest candidate for these sequences (ties: the earlier candidate). Shared
        prompts also weigh splitting a group into rows of 2, 4, 8, ... responses. `groups`: the
        sequences' prompt groups when the caller has them (else computed here, once)."""
        options: list[Layout] = []
        for name in self.candidates:
            options.append(LAYOUTS[name])
            if name == "shared_prompt":
                if self.flat:
                    options.append(SharedPromptLayout(flat=True))
                if groups is None:
                    groups = prompt_groups(tokens, response_lengths)
                largest = max(map(len, groups))
                k = 2
                while k < largest:
                    options.append(SharedPromptLayout(per_row=k))
                    k *= 2
        if self.max_width is not None:  # exact: one-block rows of several sequences first
            cap = self.max_width
            narrow = [
                o for o in options if o.name != "padded" and o.width(tokens, response_lengths, groups) <= cap
            ]
            if narrow:
                options = [o for o in options if o.name == "padded"] + narrow
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
