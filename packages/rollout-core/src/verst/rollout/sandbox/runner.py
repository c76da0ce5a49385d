"""One execution: write the inputs, start bwrap (or, only where the config allows it, a plain
subprocess), read capped output, enforce the wall clock by killing the whole process group.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path, PurePosixPath

from verst.rollout.sandbox.bwrap import INDIR, WORKDIR, BwrapPlan, bwrap_argv, host_python
from verst.rollout.sandbox.config import SandboxConfig, SandboxLimits
from verst.rollout.sandbox.launcher import LAUNCHER_SOURCE, SYNTAX_EXIT
from verst.rollout.sandbox.result import ExecResult, ExecStatus

log = logging.getLogger(__name__)

_CHUNK = 1 << 16


class SandboxError(ValueError):
    """Bad input to an execution (a file name that escapes the working directory)."""


def rlimits(limits: SandboxLimits) -> dict[str, tuple[int, int]]:
    """The rlimits (name -> soft, hard) the launcher sets before user code runs."""
    cpu = max(1, round(limits.cpu_s))
    return {
        "RLIMIT_CPU": (cpu, cpu + 1),
        "RLIMIT_AS": (limits.memory_mb << 20, limits.memory_mb << 20),
        "RLIMIT_NPROC": (limits.processes, limits.processes),
        "RLIMIT_FSIZE": (limits.file_size_mb << 20, limits.file_size_mb << 20),
        "RLIMIT_NOFILE": (limits.open_files, limits.open_files),
        "RLIMIT_CORE": (0, 0),
    }


def _check_name(name: str) -> PurePosixPath:
    """`name` as a relative path inside the working directory, or `SandboxError`."""
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts or name in ("main.py", "."):
        raise SandboxError(
            f"sandbox file name {name!r} must be a relative path inside the working directory "
            f"(no '..', not absolute, not main.py)"
        )
    return path


def write_inputs(indir: Path, code: str, stdin: str, files: dict[str, str] | None) -> None:
    """main.py, stdin and files/ in the host folder bound at /in (readable by the sandbox uid)."""
    (indir / "files").mkdir(parents=True)
    for name, text in (files or {}).items():
        dst = indir / "files" / _check_name(name)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(text)
    (indir / "files" / "main.py").write_text(code)
    (indir / "stdin").write_text(stdin)
    for root, dirs, names in os.walk(indir):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o755)
        for n in names:
            os.chmod(os.path.join(root, n), 0o644)
    os.chmod(indir, 0o755)


class _Capture:
    """Reads one stream up to `cap` bytes; `over` is set once more arrived."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.buf = bytearray()
        self.over = False

    async def drain(self, stream: asyncio.StreamReader, on_over: asyncio.Event) -> None:
        """Keep the first `cap` bytes; read the rest to its end and drop it (a stream left
        unread would keep asyncio from ever seeing the process end)."""
        while chunk := await stream.read(_CHUNK):
            room = self.cap - len(self.buf)
            if len(chunk) > room:
                self.buf += chunk[: max(room, 0)]
                self.over = True
                on_over.set()
            else:
                self.buf += chunk

    def text(self) -> str:
        return self.buf.decode("utf-8", errors="replace")


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the process group of bwrap (its inner init dies with it: --die-with-parent,
    and with the pid namespace's init every process inside)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _status(code: int | None, timed_out: bool, over: bool) -> ExecStatus:
    if over:
        return ExecStatus.OUTPUT_LIMIT
    if timed_out:
        return ExecStatus.TIMEOUT
    if code == 0:
        return ExecStatus.OK
    if code == SYNTAX_EXIT:
        return ExecStatus.SYNTAX_ERROR
    if code is not None and (code < 0 or code > 128):
        return ExecStatus.KILLED
    return ExecStatus.ERROR


async def _finish(proc: asyncio.subprocess.Process, out: _Capture, err: _Capture, over: asyncio.Event) -> int:
    """Both streams read to their end (or the cap), then the exit status."""
    await asyncio.gather(out.drain(proc.stdout, over), err.drain(proc.stderr, over))  # type: ignore[arg-type]
    return await proc.wait()


async def _reap(proc: asyncio.subprocess.Process, finish: asyncio.Future[int]) -> None:
    """After the kill: let the readers see the end of both streams and the exit be collected;
    where something still holds the pipes after 5 s, close them."""
    try:
        await asyncio.wait_for(asyncio.shield(finish), 5.0)
    except (TimeoutError, asyncio.CancelledError, OSError):
        finish.cancel()
        transport = getattr(proc, "_transport", None)  # asyncio offers no public way to drop the pipes
        if transport is not None:
            transport.close()
        await asyncio.gather(finish, return_exceptions=True)


def _write_secret(fd: int, secret: bytes) -> None:
    """Write the secret into its pipe and close it (a sandbox that died first: EPIPE, ignored)."""
    with contextlib.suppress(OSError):
        view = memoryview(secret)
        while view:
            view = view[os.write(fd, view) :]
    os.close(fd)


async def _run_proc(
    argv: list[str], limits: SandboxLimits, secret: tuple[int, int, bytes] | None = None
) -> ExecResult:
    """Start `argv` in its own process group, capture capped output, enforce the wall clock.
    `secret`: (read fd handed to the child, write fd, bytes written into it once it runs)."""
    start = time.perf_counter()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            pass_fds=(secret[0],) if secret else (),
        )
    finally:
        if secret:
            os.close(secret[0])
    writer = asyncio.ensure_future(asyncio.to_thread(_write_secret, secret[1], secret[2])) if secret else None
    out, err = _Capture(limits.max_output_bytes), _Capture(limits.max_output_bytes)
    over = asyncio.Event()
    finish = asyncio.ensure_future(_finish(proc, out, err, over))
    over_wait = asyncio.ensure_future(over.wait())
    code: int | None = None
    try:
        done, _ = await asyncio.wait(
            {finish, over_wait}, timeout=limits.wall_s, return_when="FIRST_COMPLETED"
        )
        if finish in done and not over.is_set():
            code = finish.result()
    finally:
        _kill_group(proc)
        over_wait.cancel()
        await _reap(proc, finish)
        if writer is not None:
            await writer
    timed_out = code is None and not over.is_set()
    return ExecResult(
        status=_status(code, timed_out, over.is_set()),
        exit_code=code,
        stdout=out.text(),
        stderr=err.text(),
        stdout_truncated=out.over,
        stderr_truncated=err.over,
        wall_s=time.perf_counter() - start,
    )


def uid_processes(uid: int) -> int:
    """Live (non-zombie) processes of `uid` on the host, from /proc."""
    n = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as f:
                text = f.read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        if fields.get("Uid", "").split()[:1] == [str(uid)] and not fields.get("State", "").strip().startswith(
            "Z"
        ):
            n += 1
    return n


async def wait_gone(uid: int | None, timeout_s: float = 2.0) -> None:
    """Wait until the kernel has torn down every process of a worker's uid (the pid namespace
    dies with its init, asynchronously); host root only, where each worker has its own uid."""
    if uid is None:
        return
    deadline = time.monotonic() + timeout_s
    while uid_processes(uid) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


class SandboxRunner:
    """Runs one piece of code at a time for one worker slot (its own uid where the host is root)."""

    def __init__(self, cfg: SandboxConfig, slot: int = 0, *, unsandboxed: bool = False) -> None:
        self.cfg = cfg
        """The sandbox configuration."""
        self.uid = cfg.uid_base + slot if os.geteuid() == 0 else None
        """The uid code runs as (host root only), else None (a user namespace)."""
        self.unsandboxed = unsandboxed
        """Run without bwrap (only when the pool found it unusable and the config allows it)."""

    def _launcher_args(self, indir: str, workdir: str, uid: int | None, secret_fd: int | None) -> str:
        python = host_python(self.cfg.python)
        return json.dumps(
            {
                "uid": uid,
                "limits": rlimits(self.cfg.limits),
                "python": python,
                "indir": indir,
                "workdir": workdir,
                "main": workdir + "/main.py",
                "syntax_exit": SYNTAX_EXIT,
                "secret_fd": secret_fd,
            }
        )

    def argv(self, tmp: Path, secret_fd: int | None = None) -> list[str]:
        """The command line of one execution whose inputs are in `tmp / "in"` (`secret_fd`: the
        inherited pipe the launcher moves to `SECRET_FD`)."""
        python = host_python(self.cfg.python)
        if self.unsandboxed:
            (tmp / "work").mkdir(exist_ok=True)
            args = self._launcher_args(str(tmp / "in"), str(tmp / "work"), None, secret_fd)
            return [python, "-I", "-S", "-c", LAUNCHER_SOURCE, args]
        launcher_args = self._launcher_args(INDIR, WORKDIR, self.uid, secret_fd)
        inner = [python, "-I", "-S", "-c", LAUNCHER_SOURCE, launcher_args]
        return bwrap_argv(self.cfg, BwrapPlan(indir=str(tmp / "in"), uid=self.uid), inner)

    async def run(
        self, code: str, stdin: str = "", files: dict[str, str] | None = None, secret: bytes | None = None
    ) -> ExecResult:
        """Execute `code` as main.py with `stdin` and `files` in a fresh sandbox; `secret`, if
        given, is readable once from fd `SECRET_FD` (a pipe; it is in no file the code can read)."""
        tmp = Path(tempfile.mkdtemp(prefix="verst-sandbox-", dir=self.cfg.tmp_dir or None))
        pipe = None
        try:
            write_inputs(tmp / "in", code, stdin, files)
            pipe = (*os.pipe(), secret) if secret is not None else None
            if self.unsandboxed:
                log.warning(
                    "UNSANDBOXED execution (sandbox.allow_unsandboxed = true, bwrap not usable): "
                    "the code can read and write this host"
                )
            res = await _run_proc(self.argv(tmp, pipe[0] if pipe else None), self.cfg.limits, pipe)
            await wait_gone(None if self.unsandboxed else self.uid)
            return res
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def probe(self) -> subprocess.CompletedProcess[bytes]:
        """Run `print('ok')` synchronously in the sandbox (the pool's check before any work)."""
        tmp = Path(tempfile.mkdtemp(prefix="verst-sandbox-", dir=self.cfg.tmp_dir or None))
        try:
            write_inputs(tmp / "in", "print('ok')", "", None)
            return subprocess.run(self.argv(tmp), capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
