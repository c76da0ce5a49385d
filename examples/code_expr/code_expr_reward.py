"""Reward of the code-expression example: the fraction of the row's hidden tests the answer
passes, run in the bubblewrap sandbox (`verst.rollout.sandbox`).

The label is `{"prefix": code the answer completes, "tests": [assert statements] | program}`
(the row format of the built-in `code_tests` reward). The program is `prefix + answer`, then
each assert in its own `try` (so one failing assert does not hide the others), then a line
with the count; one sandbox execution per sample. A test program given as one string (as
HumanEval's `check(...)`) scores 1 when it exits 0, else 0. An answer that does not compile,
times out or is killed scores 0.

This is the example's own copy of that scoring until `rollout.reward.type = "code_tests"` is
on main; `verst train` puts the config's folder on `sys.path`, so the config names it
`"code_expr_reward:CodeTests"` (a class: one sandbox pool per run).
"""

from __future__ import annotations

import json
import re

from verst.rollout.rewards.rules import strip_trailing_stop
from verst.rollout.sample import Sample, Status
from verst.rollout.sandbox import SandboxConfig, SandboxPool

MARK = "__verst_passed__"


def completion(label: dict, response: str) -> str:
    """The code of a response: the inside of its first ```python fence when it has one (a chat
    model's habit; it then follows the prefix as top-level code), else the text cut at the first
    of the label's `stop` strings (HumanEval's: where top-level code starts) and a trailing EOS."""
    fence = re.search(r"```(?:python|py)?\n(.*?)(?:```|$)", response, re.DOTALL)
    if fence:
        return "\n" + strip_trailing_stop(fence.group(1))
    text = response
    for stop in label.get("stop", ()):
        text = text.split(stop, 1)[0]
    return strip_trailing_stop(text)


def program(label: dict, answer: str) -> str:
    """The code one sandbox execution runs for `answer`."""
    code = label["prefix"] + completion(label, answer) + "\n"
    tests = label["tests"]
    if isinstance(tests, str):
        return code + tests
    return code + (
        f"_t = {json.dumps(tests)}\n_n = 0\n"
        "for _s in _t:\n"
        "    try:\n        exec(_s)\n        _n += 1\n"
        "    except BaseException:\n        pass\n"
        f"print({MARK!r}, _n)\n"
    )


def passed_fraction(label: dict, ok: bool, stdout: str) -> float:
    """The score of one execution's result, in [0, 1] (a count line the answer printed itself
    cannot score more than all tests; this stand-in does not hide the count from the code it runs:
    the built-in `code_tests` is the hardened one)."""
    tests = label["tests"]
    if isinstance(tests, str):
        return float(ok)
    lines = [ln for ln in stdout.splitlines() if ln.startswith(MARK)]
    if not ok or not lines:
        return 0.0
    try:
        return min(1.0, max(0.0, int(lines[-1].split()[-1]) / len(tests)))
    except ValueError:
        return 0.0


class CodeTests:
    """The reward: one sandbox pool for the run, one execution per sample."""

    def __init__(self) -> None:
        self.pool = SandboxPool(SandboxConfig())
        """Bounds the executions at once (the config's workers)."""

    async def __call__(self, sample: Sample) -> float:
        if sample.status is not Status.COMPLETED:
            return 0.0
        label = sample.label
        result = await self.pool.run(program(label, sample.response))
        return passed_fraction(label, result.ok, result.stdout)


def final_answer(response: str) -> str:
    """The text after the last tool response (the whole response without a tool call)."""
    return strip_trailing_stop(response.rsplit("</tool_response>", 1)[-1]).strip()


class CodeToolTests(CodeTests):
    """The multi-turn variant's reward: the final answer of the episode vs the hidden tests."""

    async def __call__(self, sample: Sample) -> float:
        if sample.status is not Status.COMPLETED:
            return 0.0
        answer = final_answer(sample.response)
        if "<tool_call>" in answer:  # the episode ended on a call (e.g. a tool error), not an answer
            return 0.0
        result = await self.pool.run(program(sample.label, answer))
        return passed_fraction(sample.label, result.ok, result.stdout)
