"""Reward of the tool-math example: 1 when the final answer is the exact product, else 0.

The final answer is the text of the last model turn: after the last `</tool_response>` when the
model called the tool, else the whole response; a trailing EOS is ignored. The episode must
have ended on its own (status COMPLETED), not on a limit.
"""

from __future__ import annotations

from verst.rollout.rewards.rules import strip_trailing_stop
from verst.rollout.sample import Sample, Status


def final_answer(response: str) -> str:
    """The text after the last tool response, without a trailing stop token."""
    tail = response.rsplit("</tool_response>", 1)[-1]
    return strip_trailing_stop(tail).strip()


def reward(sample: Sample) -> float:
    """1.0 for the exact product, else 0.0."""
    if sample.status is not Status.COMPLETED:
        return 0.0
    return float(final_answer(sample.response) == str(sample.label))
