"""Turning a judge's verdict into a score: one class per `rollout.reward.judge.parser`.

- `number`: the verdict holds exactly one number in `[min_score, max_score]`; the score is that
  number mapped linearly to `[0, 1]`. No number (empty, prose, another language's words), two or
  more different numbers, or a number out of range is an error.
- `choice`: the verdict holds exactly one of the `choices` words (whole words, case-insensitive);
  the score is that word's value. None of them, or two different ones, is an error.
- `yes_no_logprob`: the judge's first verdict token is scored, not sampled: with `lp(yes)` and
  `lp(no)` the log-probs of the `yes` and `no` tokens there, the score is
  `exp(lp(yes)) / (exp(lp(yes)) + exp(lp(no)))` (in `[0, 1]`). Neither log-prob known is an error.

A parser that cannot score raises `JudgeVerdictError` (a `JudgeError`) with the verdict's preview,
which the strategy counts as a reward error.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

if TYPE_CHECKING:
    from verst.rollout.config import JudgeConfig

_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?!\w)")


class JudgeError(RuntimeError):
    """The judge could not score a sample (timeout, a dead judge, a bad verdict or template); the
    strategy counts it as a reward error."""


class JudgeVerdictError(JudgeError, ValueError):
    """The judge's verdict could not be parsed into a score; the message quotes it."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the judge answered: its text and, when asked, the log-probs of the yes/no tokens at
    the first verdict position (`{"yes": lp, "no": lp}`; a missing key = not among those known)."""

    text: str
    logprobs: Mapping[str, float] = field(default_factory=dict)


def _preview(text: str) -> str:
    return repr(text[:120] + ("…" if len(text) > 120 else ""))


class VerdictParser(Protocol):
    """Turns a `Verdict` into a float score or raises `JudgeVerdictError`."""

    needs_logprobs: ClassVar[bool]

    def __call__(self, verdict: Verdict) -> float: ...


class NumberParser:
    """`parser = "number"`: one number in `[min_score, max_score]`, mapped to `[0, 1]`."""

    needs_logprobs: ClassVar[bool] = False

    def __init__(self, min_score: float, max_score: float) -> None:
        if not max_score > min_score:
            raise ValueError(f"max_score ({max_score}) must exceed min_score ({min_score})")
        self.min_score, self.max_score = min_score, max_score

    def __call__(self, verdict: Verdict) -> float:
        found = {float(m) for m in _NUMBER.findall(verdict.text)}
        if not found:
            raise JudgeVerdictError(f"no number in the judge's verdict {_preview(verdict.text)}")
        if len(found) > 1:
            raise JudgeVerdictError(
                f"{len(found)} different numbers in the judge's verdict {_preview(verdict.text)}; "
                f"ask for exactly one score"
            )
        value = found.pop()
        if not self.min_score <= value <= self.max_score:
            raise JudgeVerdictError(
                f"the judge's score {value:g} is outside [{self.min_score:g}, {self.max_score:g}] "
                f"(verdict {_preview(verdict.text)})"
            )
        return (value - self.min_score) / (self.max_score - self.min_score)


class ChoiceParser:
    """`parser = "choice"`: exactly one of the choice words, scored by the table."""

    needs_logprobs: ClassVar[bool] = False

    def __init__(self, choices: Mapping[str, float]) -> None:
        if not choices:
            raise ValueError("parser = 'choice' needs at least one choice")
        self.choices = {k.lower(): float(v) for k, v in choices.items()}
        words = "|".join(re.escape(k) for k in sorted(self.choices, key=len, reverse=True))
        self._pattern = re.compile(rf"(?<!\w)({words})(?!\w)", re.IGNORECASE)

    def __call__(self, verdict: Verdict) -> float:
        found = {m.lower() for m in self._pattern.findall(verdict.text)}
        if len(found) != 1:
            what = "none" if not found else f"{sorted(found)}"
            raise JudgeVerdictError(
                f"the judge's verdict {_preview(verdict.text)} names {what} of the choices "
                f"{sorted(self.choices)}; it must name exactly one"
            )
        return self.choices[found.pop()]


class YesNoLogprobParser:
    """`parser = "yes_no_logprob"`: P(yes) / (P(yes) + P(no)) at the first verdict token."""

    needs_logprobs: ClassVar[bool] = True

    def __call__(self, verdict: Verdict) -> float:
        yes, no = verdict.logprobs.get("yes"), verdict.logprobs.get("no")
        if yes is None and no is None:
            raise JudgeVerdictError(
                f"the judge returned no log-prob of 'yes' or 'no' (verdict {_preview(verdict.text)})"
            )
        if yes is None:
            return 0.0
        if no is None:
            return 1.0
        top = max(yes, no)
        py, pn = math.exp(yes - top), math.exp(no - top)
        return py / (py + pn)


JUDGE_PARSERS = ("number", "choice", "yes_no_logprob")
"""Valid `rollout.reward.judge.parser` names."""


def build_parser(config: JudgeConfig) -> VerdictParser:
    """The parser `config.parser` names (a `ValueError` for an unknown one or bad settings)."""
    if config.parser == "number":
        return NumberParser(config.min_score, config.max_score)
    if config.parser == "choice":
        return ChoiceParser(config.choices)
    if config.parser == "yes_no_logprob":
        return YesNoLogprobParser()
    raise ValueError(f"unknown judge parser {config.parser!r}; valid: {list(JUDGE_PARSERS)}")
