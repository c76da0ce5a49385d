"""Log previews stay bounded whatever the input (100k-char responses, huge reward dicts)."""

from __future__ import annotations

import logging

from hypothesis import given, settings
from hypothesis import strategies as st

from verst.rollout.logging_utils import (
    log_first_sample,
    log_rollout_finish,
    reward_log_summary,
    sample_text_preview,
)
from verst.rollout.sample import Sample, Status


@settings(deadline=None, max_examples=60)
@given(st.text(max_size=3000), st.integers(0, 500))
def test_preview_is_bounded_and_exact_when_short(text, limit):
    out = sample_text_preview(text, limit)
    assert len(out) <= limit + 48
    assert "\n" not in out
    if len(text) <= limit:
        assert out == text.replace("\n", "⏎").replace("\r", "␍")


def test_preview_of_a_100k_response_keeps_head_tail_and_count():
    text = "A" * 50_000 + "B" * 50_000
    out = sample_text_preview(text, 200)
    assert len(out) <= 248
    assert out.startswith("A" * 100) and out.endswith("B" * 100)
    assert "[99800 chars omitted]" in out


def test_reward_summary_is_bounded():
    huge = {f"metric_{i}_" + "k" * 500: float(i) for i in range(10_000)}
    out = reward_log_summary(huge)
    assert len(out) < 8 * 80 + 40 and "(+9992 more)" in out
    assert reward_log_summary(0.123456) == "0.1235"
    assert reward_log_summary(None) == "None"
    nested = reward_log_summary({"x": list(range(10_000))})
    assert len(nested) < 90


def test_first_sample_and_finish_lines_are_bounded(caplog):
    s = Sample(
        prompt="q" * 100_000,
        tokens=list(range(100_010)),
        response_length=100_000,
        response="r" * 100_000,
        reward={f"k{i}": 1.0 for i in range(5000)},
        status=Status.TRUNCATED,
    )
    logger = logging.getLogger("verst.test.previews")
    with caplog.at_level(logging.INFO, logger="verst.test.previews"):
        log_first_sample(logger, s)
        log_rollout_finish(logger, 3, {f"rollout/m{i}": float(i) for i in range(1000)})
    first, finish = (r.getMessage() for r in caplog.records)
    assert len(first) < 1500 and "status=truncated" in first and "chars omitted" in first
    assert len(finish) < 2000 and finish.startswith("rollout 3 finished") and "(+976 more)" in finish
