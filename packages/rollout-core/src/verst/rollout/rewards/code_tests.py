"""`code_tests` / `code_tests_binary`: run the sample's code against the row's tests in the sandbox.

The code: the inside of the response's first ```` ```python ```` (or ```` ``` ````, ```` ```py ````)
fence, which then follows the label's `prefix` as top-level code; without a fence, the whole
answer, cut at the first of the label's `stop` strings, with a trailing EOS / stop string
removed. In an agentic episode the answer is the text after the last `</tool_response>`.

The label (docs/code.md): `{"prefix": str = "", "tests": ..., "stop": [str] = []}` where `tests` is
- a list of assert statements (each one test), or one string (a test program, e.g. HumanEval's
  `check(...)`: one test): one sandbox execution per sample. The harness (main.py) reads a random
  per-execution marker and the tests from the secret pipe (`SECRET_FD`; they are in no file the
  code can read), runs prefix + code as module `solution`, then each test in its namespace and,
  only after it returned, writes `<marker> <i>`; at the end `<marker> end`. A run without the end
  line (the code exited early: `sys.exit(0)`, `os._exit(0)`) scores 0; a marker-shaped line that
  is not one of this run's scores 0 (`tampered`).
- a list of `{"input": str, "output": str}`: one sandbox execution per pair, prefix + code as
  `__main__` with `input` on stdin; it passes when stdout equals `output` (trailing whitespace of
  each line and trailing blank lines ignored). The expected output never enters the sandbox.

Reward: the fraction of tests passed (`code_tests`), or 1.0 only when all pass
(`code_tests_binary`). A sample whose code is missing, does not compile, times out, is killed
(CPU, memory), floods its output or whose top-level code raises scores 0. Each sample's outcome
kind goes to `sample.metadata["reward_outcome"]`; the rollout counts them as
`rollout/reward_outcome/<kind>` (`OUTCOMES`).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from verst.rollout.rewards.outcomes import REWARD_OUTCOME_KEY
from verst.rollout.rewards.rules import strip_trailing_stop
from verst.rollout.sample import Sample, Status
from verst.rollout.sandbox import SECRET_FD, ExecResult, ExecStatus, SandboxConfig, SandboxPool

OUTCOMES = (
    "pass", "partial", "fail", "no_code", "syntax_error", "error", "exited_early",
    "timeout", "killed", "output_limit", "sandbox_error", "tampered",
)  # fmt: skip
"""Outcome kinds: all / some / no tests passed; or why the sample scored 0 without running them."""

_FENCE = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_MARKER_LINE = re.compile(r"^[0-9a-f]{32} (?:\d+|end)$")

HARNESS = f"""\
import json as _json, os as _os, sys as _sys, traceback as _tb, types as _types
def _verst_harness(read=_os.read, write=_os.write, close=_os.close, dup=_os.dup, compile=compile,
                   exec=exec, Exception=Exception, format_exc=_tb.format_exc, exit=_os._exit):
    buf = b""
    while chunk := read({SECRET_FD}, 1 << 16):
        buf += chunk
    close({SECRET_FD})
    secret = _json.loads(buf)
    marker, tests, out = secret["marker"], secret["tests"], dup(1)
    del buf, secret
    with open("solution.py", encoding="utf-8") as f:
        source = f.read()
    try:
        code = compile(source, "solution.py", "exec")
    except (SyntaxError, ValueError) as exc:
        _sys.stderr.write("".join(_tb.format_exception_only(type(exc), exc)))
        _sys.stderr.flush()
        exit(86)
    module = _types.ModuleType("solution")
    _sys.modules["solution"] = module
    exec(code, module.__dict__)
    for i, test in enumerate(tests):
        try:
            exec(compile(test, "test_%d" % i, "exec"), module.__dict__)
        except Exception:
            _sys.stderr.write("test %d failed:\\n%s" % (i, format_exc(limit=-3)))
            continue
        write(out, ("\\n%s %d\\n" % (marker, i)).encode())
    write(out, ("\\n%s end\\n" % marker).encode())
_verst_harness()
"""
"""main.py of an assert-test execution (no secret in it: the marker and tests come from the pipe)."""


def final_answer(response: str) -> str:
    """The text after the last tool response (the whole response outside agentic episodes)."""
    return response.rsplit("</tool_response>", 1)[-1]


def extract_code(response: str, label: dict[str, Any], stops: Sequence[str] = ()) -> str | None:
    """The code of `response` (see the module docstring), or None when there is none."""
    answer = final_answer(response)
    fence = _FENCE.search(answer)
    if fence:
        code = "\n" + fence.group(1)
    elif "<tool_call>" in answer:  # the episode ended on a call, not an answer
        return None
    else:
        code = answer
        for stop in label.get("stop", ()):
            code = code.split(stop, 1)[0]
    code = strip_trailing_stop(code, stops)
    return code if code.strip() else None


def _outputs_match(got: str, want: str) -> bool:
    def norm(text: str) -> list[str]:
        lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    return norm(got) == norm(want)


_FATAL = {
    ExecStatus.SYNTAX_ERROR: "syntax_error",
    ExecStatus.TIMEOUT: "timeout",
    ExecStatus.KILLED: "killed",
    ExecStatus.OUTPUT_LIMIT: "output_limit",
    ExecStatus.SANDBOX_ERROR: "sandbox_error",
}


@dataclass(frozen=True, slots=True)
class TestOutcome:
    """What one sample's tests gave."""

    passed: int
    total: int
    kind: str
    """One of `OUTCOMES`."""

    @staticmethod
    def of_counts(passed: int, total: int) -> TestOutcome:
        kind = "pass" if passed == total else "partial" if passed else "fail"
        return TestOutcome(passed, total, kind)


def check_label(label: Any) -> list[Any]:
    """The label's tests as a non-empty list, or `ValueError` saying what the row needs."""
    tests = label.get("tests") if isinstance(label, dict) else None
    if isinstance(tests, str):
        tests = [tests]
    shapes = {type(t) for t in tests} if isinstance(tests, list) else set()
    if not tests or shapes not in ({str}, {dict}):
        raise ValueError(
            f"code_tests needs a label {{'prefix': str, 'tests': [assert statements] | program | "
            f"[{{'input': str, 'output': str}}]}}; got {label!r:.200}"
        )
    if shapes == {dict} and not all(
        isinstance(t.get("input"), str) and isinstance(t.get("output"), str) for t in tests
    ):
        raise ValueError(
            f"code_tests: every input/output test needs str 'input' and 'output'; got {tests!r:.200}"
        )
    return tests


class CodeTestsReward:
    """The `code_tests` reward (module docstring): one sandbox pool for the run."""

    def __init__(
        self, sandbox: SandboxConfig | None = None, *, binary: bool = False, stops: Sequence[str] = ()
    ):
        self.pool = SandboxPool(sandbox or SandboxConfig())
        """Bounds the executions at once (`sandbox.workers`), shared by every sample."""
        self.pool.check()  # no bwrap here: one line saying what to install, before any work
        self.binary = binary
        """1.0 only when every test passes (`code_tests_binary`)."""
        self.stops = tuple(stops)
        """`rollout.stop` strings stripped from the end of the code."""

    async def __call__(self, sample: Sample) -> float:
        outcome = await self.outcome(sample)
        sample.metadata[REWARD_OUTCOME_KEY] = outcome.kind
        if self.binary:
            return float(outcome.passed == outcome.total)
        return outcome.passed / outcome.total

    async def outcome(self, sample: Sample) -> TestOutcome:
        """Run the sample's code against its tests."""
        tests = check_label(sample.label)
        code = (
            extract_code(sample.response, sample.label, self.stops)
            if sample.status is Status.COMPLETED
            else None
        )
        if code is None:
            return TestOutcome(0, len(tests), "no_code")
        source = str(sample.label.get("prefix", "")) + code + "\n"
        if isinstance(tests[0], dict):
            return await self._io_tests(source, tests)
        return await self._assert_tests(source, tests)

    async def _assert_tests(self, source: str, tests: list[str]) -> TestOutcome:
        marker = secrets.token_hex(16)
        secret = json.dumps({"marker": marker, "tests": tests}).encode()
        res = await self.pool.run(HARNESS, files={"solution.py": source}, secret=secret)
        return assert_outcome(res, marker, len(tests))

    async def _io_tests(self, source: str, tests: list[dict[str, str]]) -> TestOutcome:
        passed = 0
        for test in tests:  # in order, stopping at a fatal outcome; samples run concurrently
            res = await self.pool.run(source, stdin=test["input"])
            if res.status in _FATAL:
                return TestOutcome(0, len(tests), _FATAL[res.status])
            passed += res.ok and _outputs_match(res.stdout, test["output"])
        return TestOutcome.of_counts(passed, len(tests))

    async def aclose(self) -> None:
        """Drop the pool's slots."""
        await self.pool.close()


def assert_outcome(res: ExecResult, marker: str, total: int) -> TestOutcome:
    """The outcome of one harness execution with this run's `marker`."""
    if res.status in _FATAL:
        return TestOutcome(0, total, _FATAL[res.status])
    passed: set[int] = set()
    ended = False
    for line in res.stdout.splitlines():
        if not _MARKER_LINE.match(line):
            continue
        head, tail = line.split(" ")
        if head != marker:
            return TestOutcome(0, total, "tampered")
        if tail == "end":
            ended = True
        elif int(tail) < total:
            passed.add(int(tail))
        else:
            return TestOutcome(0, total, "tampered")
    if not res.ok:
        return TestOutcome(0, total, "error")
    if not ended:
        return TestOutcome(0, total, "exited_early")
    return TestOutcome.of_counts(len(passed), total)
