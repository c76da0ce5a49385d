"""Running one sync tool call so that its timeout can really stop it.

`sync_tool_runner = "process"` (the default): the call runs in a child forked from this process
(the tool, its arguments and module state are inherited, nothing is pickled on the way in). The
result or the exception comes back pickled through a pipe. When the caller gives up — the
tool's `tool_timeout_s` passed, or the rollout was cancelled — the child is killed with SIGKILL
and reaped, so the tool stops where it is. What a tool changes in its own memory stays in the
child (a tool that updates a global counter must use the thread runner); a result that cannot
be pickled comes back as an error. Forking a process that runs threads can leave a lock held in
the child; the worst case is a tool that hangs and is killed at its timeout.

`"thread"`: `asyncio.to_thread`, in this process. A timed-out call cannot be stopped; its thread
runs to completion in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import signal
from collections.abc import Callable
from typing import Any, Literal

SyncToolRunner = Literal["process", "thread"]
"""How sync tools run (`ToolEnvironmentConfig.sync_tool_runner`)."""


def _child(fn: Callable[..., Any], arguments: dict[str, Any], write_fd: int) -> None:
    """In the forked child: run the tool, send ("ok", result) or ("error", exception), exit."""
    try:
        try:
            payload: tuple[str, Any] = ("ok", fn(**arguments))
        except BaseException as exc:
            payload = ("error", exc)
        try:
            data = pickle.dumps(payload)
        except Exception as exc:
            data = pickle.dumps(("error", TypeError(f"the tool's result cannot be sent back: {exc}")))
        with os.fdopen(write_fd, "wb") as out:
            out.write(data)
    finally:
        os._exit(0)  # no atexit handlers, no flushing of the parent's buffers


def _read_all(fd: int) -> bytes:
    with os.fdopen(fd, "rb") as pipe:
        return pipe.read()


async def run_in_child(fn: Callable[..., Any], arguments: dict[str, Any]) -> Any:
    """`fn(**arguments)` in a forked child; the child is killed if this coroutine is cancelled
    (e.g. by `asyncio.wait_for`'s timeout). Re-raises the tool's exception."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(read_fd)
        _child(fn, arguments, write_fd)
    os.close(write_fd)
    loop = asyncio.get_running_loop()
    try:
        data = await loop.run_in_executor(None, _read_all, read_fd)  # EOF once the child exits
    finally:
        _kill_and_reap(pid)
    if not data:
        raise RuntimeError("the tool's process ended without a result (killed, or it exited itself)")
    status, value = pickle.loads(data)
    if status == "error":
        raise value
    return value


def _kill_and_reap(pid: int) -> None:
    """SIGKILL the child (a no-op if it already exited) and wait for it, so no zombie is left."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


async def run_sync_tool(fn: Callable[..., Any], arguments: dict[str, Any], runner: SyncToolRunner) -> Any:
    """One sync tool call with the configured runner."""
    if runner == "process":
        return await run_in_child(fn, arguments)
    return await asyncio.to_thread(fn, **arguments)
