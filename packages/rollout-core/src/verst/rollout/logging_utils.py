"""Bounded log previews shared by every rollout strategy.

A rollout can hold a 32k-token response or a reward dict with hundreds of entries; logging
them whole floods the log and slows the run. Every strategy logs its first sample and its
finish line through these helpers, whose output length is bounded whatever the input.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from verst.rollout.sample import Sample

_LINE_BREAKS = str.maketrans({"\n": "⏎", "\r": "␍"})
"""Length-preserving replacements that keep a preview on one log line."""
_MARKER_MAX = 48
"""Upper bound on the length of the omission marker (`… [N chars omitted] …`)."""


def sample_text_preview(text: Any, limit: int = 200) -> str:
    """`text` if it has at most `limit` characters, else its head and tail around a marker.

    The result has at most `limit + 48` characters, and line breaks are shown as `⏎` so a
    preview stays on one line. Non-strings are previewed through `str()`.
    """
    if not isinstance(text, str):
        text = str(text)
    limit = max(0, limit)
    if len(text) <= limit:
        return text.translate(_LINE_BREAKS)
    head_len = (limit + 1) // 2
    tail_len = limit // 2
    omitted = len(text) - head_len - tail_len
    head = text[:head_len]
    tail = text[len(text) - tail_len :] if tail_len else ""
    return f"{head}… [{omitted} chars omitted] …{tail}".translate(_LINE_BREAKS)


def _format_value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int | float):
        return f"{value:.4g}" if isinstance(value, float) and math.isfinite(value) else str(value)
    return sample_text_preview(repr(value), 32)


def reward_log_summary(reward: Any, max_items: int = 8) -> str:
    """A short one-line summary of a float or dict reward.

    A dict shows its first `max_items` entries (keys cut to 32 characters, values to 4
    significant digits or a 32-character preview) and how many more there are.
    """
    if not isinstance(reward, Mapping):
        return _format_value(reward)
    items = []
    for i, (key, value) in enumerate(reward.items()):
        if i >= max_items:
            break
        items.append(f"{sample_text_preview(str(key), 32)}={_format_value(value)}")
    more = len(reward) - len(items)
    suffix = f", … (+{more} more)" if more > 0 else ""
    return "{" + ", ".join(items) + suffix + "}"


def log_first_sample(logger: logging.Logger, sample: Sample, *, label: str = "rollout") -> None:
    """Log one sample (status, lengths, previews of prompt, response and reward) on one line."""
    if not logger.isEnabledFor(logging.INFO):
        return
    prompt = sample.prompt if isinstance(sample.prompt, str) else repr(sample.prompt[-2:])
    logger.info(
        "%s first sample: group=%s sample=%s status=%s prompt_len=%d response_len=%d "
        "reward=%s prompt=%r response=%r",
        label,
        sample.group_index,
        sample.sample_index,
        sample.status.value,
        sample.prompt_length,
        sample.response_length,
        reward_log_summary(sample.reward),
        sample_text_preview(prompt),
        sample_text_preview(sample.response),
    )


def log_rollout_finish(
    logger: logging.Logger, rollout_id: int, metrics: Mapping[str, float], *, max_items: int = 24
) -> None:
    """Log the end of a rollout with (at most `max_items` of) its metrics."""
    if not logger.isEnabledFor(logging.INFO):
        return
    logger.info("rollout %d finished: %s", rollout_id, reward_log_summary(dict(metrics), max_items))
