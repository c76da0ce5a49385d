"""A sync tool past its `tool_timeout_s` is really stopped (issue 25, item 16): by default a sync
call runs in a forked child process that is killed at the timeout, so the tool's side effects
after that point never happen and its process is gone. `sync_tool_runner = "thread"` keeps the
old behaviour (a worker thread that cannot be stopped), for tools that must share this
process's memory; the test shows that difference too.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from agentic_testkit import call
from test_agentic_tools import _run


def sleepy_write(path: str) -> str:
    """Write this process's pid, sleep past the timeout, then write 'ran' (the side effect)."""
    Path(path + ".pid").write_text(str(os.getpid()))
    time.sleep(1.5)
    Path(path).write_text("ran")
    return "done"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_timed_out_sync_tool_is_killed_and_its_side_effect_never_happens(tmp_path):
    target = str(tmp_path / "effect")
    started = time.perf_counter()
    sample, metrics, _ = _run(
        call("sleepy_write", path=target), tools=(sleepy_write,), options={"tool_timeout_s": 0.3}
    )
    assert time.perf_counter() - started < 5
    assert "timed out after 0.3s" in sample.response and metrics["rollout/env/tool_timeouts"] == 1
    pid = int(Path(target + ".pid").read_text())
    assert pid != os.getpid(), "the sync tool ran in this process, where it cannot be stopped"
    time.sleep(2.0)  # longer than the tool's sleep: a tool still running would have written by now
    assert not Path(target).exists(), "the timed-out tool kept running and wrote its side effect"
    assert not _alive(pid)


def test_the_thread_runner_cannot_stop_a_timed_out_tool(tmp_path):
    target = str(tmp_path / "effect")
    options = {"tool_timeout_s": 0.3, "sync_tool_runner": "thread"}
    sample, _, _ = _run(call("sleepy_write", path=target), tools=(sleepy_write,), options=options)
    assert "timed out after 0.3s" in sample.response
    assert int(Path(target + ".pid").read_text()) == os.getpid()
    deadline = time.monotonic() + 5
    while not Path(target).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert Path(target).read_text() == "ran"  # documented: the thread runs to completion


@pytest.mark.parametrize("runner", ["process", "thread"])
def test_sync_tool_results_and_errors_come_back_from_either_runner(runner):
    sample, metrics, _ = _run(call("multiply", a=12, b=34), options={"sync_tool_runner": runner})
    assert "<tool_response>408</tool_response>done" in sample.response
    assert metrics["rollout/env/tool_errors"] == 0
