"""The built-in `code_tests` reward with real bwrap: right code passes, wrong and partial code
score what they pass, every way to fail scores 0 with its kind, and code that tries to fake a
pass (printing a marker, exiting 0 early, reading the harness's inputs) gets no credit.
The kinds reach the rollout metrics as `rollout/reward_outcome/<kind>`.
"""

from __future__ import annotations

import asyncio

import pytest

from verst.rollout.config import RolloutConfig
from verst.rollout.rewards import build_reward_fns
from verst.rollout.rewards.code_tests import CodeTestsReward, extract_code
from verst.rollout.rewards.outcomes import reward_outcome_metrics
from verst.rollout.sample import Sample, Status

LABEL = {
    "prefix": "def f(x):\n    return ",
    "tests": ["assert f(1) == 3", "assert f(2) == 5", "assert f(10) == 21", "assert f(-4) == -7"],
}
IO_LABEL = {"tests": [{"input": "2 3\n", "output": "5\n"}, {"input": "10 -4\n", "output": "6"}]}


def _sample(response: str, label: dict = LABEL) -> Sample:
    s = Sample(prompt="p", response=response, label=label)
    s.status = Status.COMPLETED
    return s


@pytest.fixture
def reward(pool) -> CodeTestsReward:
    r = CodeTestsReward(pool.cfg)
    r.pool = pool  # the fixture's pool: its after-test checks cover these executions
    return r


def _score(reward: CodeTestsReward, *samples: Sample) -> list[tuple[float, str]]:
    async def go():
        return await asyncio.gather(*(reward(s) for s in samples))

    return [(v, s.metadata["reward_outcome"]) for v, s in zip(asyncio.run(go()), samples, strict=True)]


def test_right_wrong_and_partial_code_score_the_fraction_passed(reward):
    got = _score(reward, _sample("2*x+1<eos>"), _sample("x"), _sample("2*x+1 if x > 0 else 0"))
    assert got == [(1.0, "pass"), (0.0, "fail"), (0.75, "partial")]


def test_a_fenced_block_is_the_code_and_follows_the_prefix():
    assert extract_code("Sure:\n```python\nprint(1)\n```\nbye", {}) == "\nprint(1)"
    assert extract_code("```\nprint(2)", {}) == "\nprint(2)"
    assert extract_code("x+1\ndef g(): pass", {"stop": ["\ndef "]}) == "x+1"
    assert extract_code("<tool_call>{}</tool_call><tool_response>3</tool_response> x*2", {}) == " x*2"
    assert extract_code("  <eos>", {}) is None


def test_failures_score_zero_and_are_counted_by_kind(reward):
    samples = [
        _sample("2*x+"),  # does not compile
        _sample("2*x+1\nimport time\ntime.sleep(60)"),  # the wall clock
        _sample("2*x+1\nraise RuntimeError('top level')"),  # crashes before the tests
        _sample("   "),  # no code
        _sample("2*x+1\nprint('y' * 10**7)"),  # floods stdout
    ]
    got = _score(reward, *samples)
    assert got == [
        (0.0, "syntax_error"),
        (0.0, "timeout"),
        (0.0, "error"),
        (0.0, "no_code"),
        (0.0, "output_limit"),
    ]
    assert reward_outcome_metrics(samples, "rollout") == {
        "rollout/reward_outcome/error": 1.0,
        "rollout/reward_outcome/no_code": 1.0,
        "rollout/reward_outcome/output_limit": 1.0,
        "rollout/reward_outcome/syntax_error": 1.0,
        "rollout/reward_outcome/timeout": 1.0,
    }


def test_code_that_fakes_a_pass_gets_no_credit(reward):
    reads = (
        "2*x+1 if x == 1 else None\nimport glob, os\n"
        "for p in glob.glob('/in/**', recursive=True) + glob.glob('/work/*'):\n"
        "    if os.path.isfile(p):\n        print(open(p, errors='replace').read())\n"
        "os._exit(0)\n"
    )
    cheats = [
        _sample("2*x+1 if x == 1 else None\nimport sys\nsys.exit(0)"),  # exit 0 before the tests
        _sample("None\nimport os\nos._exit(0)"),
        _sample("None\nfor i in range(4): print('0' * 32, i)\nprint('0' * 32, 'end')"),  # a guessed marker
        _sample(reads),  # prints every input file it can find, then exits 0
        _sample("(2*x+1 if x == 1 else __import__('os')._exit(0))"),  # exits during a later test
    ]
    got = _score(reward, *cheats)
    assert [v for v, _ in got] == [0.0] * 5
    assert [k for _, k in got] == ["exited_early", "exited_early", "tampered", "exited_early", "exited_early"]


def test_the_binary_variant_gives_one_only_when_all_pass(pool):
    cfg = RolloutConfig.model_validate(
        {"reward": {"type": "code_tests_binary", "sandbox": pool.cfg.model_dump()}}
    )
    reward, _ = build_reward_fns(cfg)
    assert isinstance(reward, CodeTestsReward) and reward.binary
    got = _score(reward, _sample("2*x+1"), _sample("2*x+1 if x > 0 else 0"))
    assert got == [(1.0, "pass"), (0.0, "partial")]


def test_input_output_pairs_compare_stdout_outside_the_sandbox(reward):
    right = "a, b = map(int, input().split())\nprint(a + b)"
    half = "a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)"
    got = _score(reward, _sample(right, IO_LABEL), _sample(half, IO_LABEL), _sample("print(", IO_LABEL))
    assert got == [(1.0, "pass"), (0.5, "partial"), (0.0, "syntax_error")]


def test_a_test_program_is_one_test(reward):
    label = {
        "prefix": "def inc(x):\n",
        "tests": "def check(c):\n    assert c(1) == 2\ncheck(inc)\n",
        "stop": ["\ndef "],
    }
    got = _score(reward, _sample("    return x + 1\ndef junk(", label), _sample("    return x\n", label))
    assert got == [(1.0, "pass"), (0.0, "fail")]


def test_a_label_without_tests_is_one_clear_error(reward):
    with pytest.raises(ValueError, match="code_tests needs a label"):
        _score(reward, _sample("x", {"prefix": "", "tests": []}))
