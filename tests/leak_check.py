"""Session-end check: everything the test session started is gone after it (issue 39 item 9).

A pytest plugin (loaded by `tests/conftest.py`). At session start it points the temp root of
the session and of every process it starts (`tempfile.tempdir`, `TMPDIR`) at a folder of its own,
`<system temp>/vt-<pid>` (removed at the end; an earlier session's left by a kill is removed at
the next start); at session end — after every session fixture has been torn
down — it waits a bounded moment for exiting processes, then lists what the session left behind:
- processes descended from the pytest process (a server, an engine, a sandbox, a Ray worker);
- TCP ports the pytest process itself still listens on;
- entries left in the session's temp root, except pytest's own `pytest-of-<user>` base (pytest
  keeps its last three runs' `tmp_path`s there by design).
Anything left fails the session with one report; the leaked processes are then killed and the
temp root removed, so the machine is clean for whatever runs next. Other jobs on the machine
cannot trip it: their processes are not the session's children and their temp files land in the
system temp root, not the session's. `VERST_LEAK_CHECK=0` switches it off for a debugging session
and `VERST_LEAK_CHECK_WAIT_S` sets the wait (both read here, the one place the suite reads them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import psutil
import pytest

WAIT_S = 10.0
"""How long processes that are already exiting get before they count as leaked (the default of
`VERST_LEAK_CHECK_WAIT_S`)."""

_IGNORED_TEMP_PREFIXES = ("pytest-of-", "torchinductor_", "vt")
"""Kept by design: pytest's `tmp_path` base (its last three runs), torch's compile cache
(`torchinductor_<user>`, reused across processes), and the temp root of a pytest session a test
started inside this one (`vt-<pid>`: that session checks its own)."""


def session_temp_root() -> Path:
    """This session's own temp root, `<system temp>/vt-<pid>` (short: Unix socket paths under it
    stay below 108 bytes; per process: two sessions at once never share one)."""
    return Path(tempfile.gettempdir()) / f"vt-{os.getpid()}"


def _remove_stale_roots() -> None:
    """Temp roots of earlier sessions whose process is gone (killed before their cleanup)."""
    for root in Path(tempfile.gettempdir()).glob("vt-*"):
        pid = root.name.removeprefix("vt-")
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(root, ignore_errors=True)


def _temp_entries(root: Path) -> list[Path]:
    try:
        return sorted(p for p in root.iterdir() if not p.name.startswith(_IGNORED_TEMP_PREFIXES))
    except OSError:
        return []


def _children() -> list[psutil.Process]:
    try:
        return [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    except psutil.Error:
        return []


def _listening_ports() -> list[int]:
    try:
        conns = psutil.Process().net_connections(kind="tcp")
    except psutil.Error:
        return []
    return sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN})


def _describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid}: {' '.join(p.cmdline())[:160] or p.name()}"
    except psutil.Error:
        return f"pid {p.pid}"


def leftovers(temp_root: Path, wait_s: float = WAIT_S) -> list[str]:
    """What the session left: one line per process, port and temp entry (empty when clean)."""
    deadline = time.monotonic() + wait_s
    while (_children() or _listening_ports() or _temp_entries(temp_root)) and time.monotonic() < deadline:
        time.sleep(0.2)
    lines = [f"process {_describe(p)}" for p in _children()]
    lines += [f"listening port 127.0.0.1:{port}" for port in _listening_ports()]
    lines += [f"temp entry {p}" for p in _temp_entries(temp_root)]
    return lines


def pytest_configure(config: pytest.Config) -> None:
    enabled = os.environ.get("VERST_LEAK_CHECK", "1") != "0"
    config._verst_leak_check = enabled  # type: ignore[attr-defined]
    if not enabled:
        return
    _remove_stale_roots()
    root = session_temp_root()
    root.mkdir(parents=True, exist_ok=True)
    config._verst_temp_root = root  # type: ignore[attr-defined]
    config._verst_leak_wait_s = float(os.environ.get("VERST_LEAK_CHECK_WAIT_S", WAIT_S))  # type: ignore[attr-defined]
    os.environ["TMPDIR"] = str(root)  # the processes the session starts
    tempfile.tempdir = str(root)  # this process (pytest's own tmp_path base included)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if not getattr(config, "_verst_leak_check", False) or exitstatus not in (0, 1):
        return  # switched off, interrupted, or a usage error: nothing meaningful to check
    if session.testscollected == 0:
        return
    root = config._verst_temp_root  # type: ignore[attr-defined]
    lines = leftovers(root, config._verst_leak_wait_s)  # type: ignore[attr-defined]
    if not lines:
        shutil.rmtree(root, ignore_errors=True)  # pytest's tmp_paths of a clean session go with it
        return
    for p in _children():
        with contextlib.suppress(psutil.Error):
            p.kill()
    shutil.rmtree(root, ignore_errors=True)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    report = "the test session left these behind (issue 39 item 9):\n  " + "\n  ".join(lines)
    if reporter is not None:
        reporter.write_sep("=", "leak check failed", red=True)
        reporter.write_line(report)
    else:
        print(report)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
