"""Rule rewards: plain functions `(response, label) -> float`, no I/O.

The registry wraps them into async `RewardFn`s after stripping a trailing EOS / stop string
from the response (`strip_trailing_stop`), so every rule sees the answer text alone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

COMMON_EOS_STRINGS = ("<eos>", "</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>")
"""End-of-sequence strings of common tokenizers, stripped when they end a response."""


def strip_trailing_stop(response: str, stops: Sequence[str] = ()) -> str:
    """`response` without trailing whitespace, EOS strings and stop strings (repeatedly)."""
    candidates = [s for s in (*stops, *COMMON_EOS_STRINGS) if s]
    text = response
    while True:
        stripped = text.rstrip()
        for stop in candidates:
            if stripped.endswith(stop):
                stripped = stripped[: -len(stop)]
                break
        if stripped == text:
            return text
        text = stripped


def normalize_text(text: Any) -> str:
    """Case-folded, whitespace-collapsed, without a trailing period."""
    return re.sub(r"\s+", " ", str(text)).strip().casefold().rstrip(".").strip()


def exact_match(response: str, label: Any) -> float:
    """1.0 when the normalised response equals the normalised label (or any of a list's)."""
    if label is None:
        return 0.0
    labels = label if isinstance(label, (list, tuple)) else [label]
    got = normalize_text(response)
    return 1.0 if any(got == normalize_text(lab) for lab in labels) else 0.0


def partial_credit(response: str, label: Any) -> float:
    """Fraction of label positions whose character the response matches (in [0, 1]).

    `sum(response[i] == label[i]) / len(label)` after stripping surrounding whitespace; extra
    response characters are not counted. An empty label scores 1.0 only for an empty response.
    This is the reward of the digit-reversal example: every correct digit counts.
    """
    if label is None:
        return 0.0
    got, want = str(response).strip(), str(label).strip()
    if not want:
        return 1.0 if not got else 0.0
    return sum(a == b for a, b in zip(got, want, strict=False)) / len(want)
