"""The judge's verdict parsers on hostile output: each scores what it documents or raises
`JudgeVerdictError` (counted as a reward error), never something else."""

from __future__ import annotations

import contextlib
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from verst.rollout.rewards.judge_parsers import (
    ChoiceParser,
    JudgeVerdictError,
    NumberParser,
    Verdict,
    YesNoLogprobParser,
)

NUMBER = NumberParser(0, 10)
CHOICE = ChoiceParser({"yes": 1.0, "no": 0.0})


@pytest.mark.parametrize(
    ("text", "score"),
    [("7", 0.7), ("Score: 10", 1.0), ("I'd say 2.5.", 0.25), ("0", 0.0), ("8 (eight), final: 8", 0.8)],
)
def test_number_scores_one_number_in_range(text, score):
    assert NUMBER(Verdict(text)) == pytest.approx(score)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "no number"),
        ("The answer looks quite good to me overall.", "no number"),
        ("La respuesta es correcta, sin duda.", "no number"),  # wrong language, no digits
        ("7 or maybe 9", "2 different numbers"),
        ("11", "outside"),
        ("-1", "outside"),
    ],
)
def test_number_refuses_hostile_verdicts(text, why):
    with pytest.raises(JudgeVerdictError, match=why):
        NUMBER(Verdict(text))


@pytest.mark.parametrize(("text", "score"), [("Yes", 1.0), ("no.", 0.0), ("Verdict: YES, clearly", 1.0)])
def test_choice_scores_exactly_one_choice(text, score):
    assert CHOICE(Verdict(text)) == score


@pytest.mark.parametrize("text", ["", "Maybe.", "Sí", "yes and no", "yesterday nothing"])
def test_choice_refuses_none_or_two(text):
    with pytest.raises(JudgeVerdictError, match="exactly one"):
        CHOICE(Verdict(text))


def test_yes_no_logprob_is_the_normalised_yes_probability():
    score = YesNoLogprobParser()(Verdict("y", {"yes": math.log(0.6), "no": math.log(0.2)}))
    assert score == pytest.approx(0.75)
    assert YesNoLogprobParser()(Verdict("", {"no": -0.1})) == 0.0
    with pytest.raises(JudgeVerdictError, match="no log-prob"):
        YesNoLogprobParser()(Verdict("whatever"))


@given(st.text(max_size=80))
def test_number_parser_scores_in_unit_range_or_refuses(text):
    with contextlib.suppress(JudgeVerdictError):
        assert 0.0 <= NUMBER(Verdict(text)) <= 1.0


@given(st.floats(-50, 50), st.floats(-50, 50))
def test_yes_no_score_is_a_probability(yes, no):
    assert 0.0 <= YesNoLogprobParser()(Verdict("", {"yes": yes, "no": no})) <= 1.0
