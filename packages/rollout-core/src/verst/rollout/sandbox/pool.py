"""`SandboxPool`: a bounded async pool of sandbox workers, so code runs while generation goes on.

Each worker slot is a `SandboxRunner` (its own uid where the host is root); `run` waits for a
free slot, executes in a fresh sandbox, and hands the slot back. `check()` proves once, before
any work, that bwrap can create its namespaces here; it raises `SandboxUnavailable` with one
line saying what to install. The pool counts executions, their statuses and their wall time.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
from collections import Counter

from verst.rollout.errors import MissingOptionalDependency
from verst.rollout.sandbox.bwrap import INSTALL_HINT
from verst.rollout.sandbox.config import SandboxConfig
from verst.rollout.sandbox.result import ExecResult
from verst.rollout.sandbox.runner import SandboxRunner

log = logging.getLogger(__name__)


class SandboxUnavailable(MissingOptionalDependency):
    """bwrap is missing or cannot create namespaces here; the message says what to install (a
    user error: `verst` prints the line and exits 2, before any work)."""


def _probe(cfg: SandboxConfig) -> str | None:
    """None where a trivial program runs in the sandbox, else the reason (one line)."""
    if shutil.which(cfg.bwrap) is None:
        return f"the code sandbox needs bwrap, which is not on PATH: {INSTALL_HINT}"
    try:
        done = SandboxRunner(cfg, 0).probe()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the code sandbox could not start ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    if done.returncode != 0 or done.stdout.strip() != b"ok":
        lines = done.stderr.decode(errors="replace").strip().splitlines() or [f"exit {done.returncode}"]
        return f"bwrap cannot create its sandbox here ({lines[-1]}); {INSTALL_HINT} and allow user namespaces"
    return None


class SandboxPool:
    """At most `cfg.workers` executions at once, each in a fresh bubblewrap sandbox."""

    def __init__(self, cfg: SandboxConfig | None = None) -> None:
        self.cfg = cfg or SandboxConfig()
        """The sandbox configuration."""
        self._free: asyncio.Queue[SandboxRunner] | None = None
        self._checked = False
        self.counts: Counter[str] = Counter()
        """Executions by status value."""
        self.exec_s = 0.0
        """Total wall seconds of executions (setup included)."""
        self.unsandboxed = False
        """Whether this pool runs code without bwrap (only with `allow_unsandboxed`)."""

    def check(self) -> None:
        """Raise `SandboxUnavailable` (one line) unless bwrap works, or the config allows running
        unsandboxed (then every execution logs that it is unsandboxed)."""
        if self._checked:
            return
        reason = _probe(self.cfg)
        if reason is not None:
            if not self.cfg.allow_unsandboxed:
                raise SandboxUnavailable(reason)
            self.unsandboxed = True
            log.warning("UNSANDBOXED code execution (sandbox.allow_unsandboxed = true): %s", reason)
        self._checked = True

    def _slots(self) -> asyncio.Queue[SandboxRunner]:
        if self._free is None:
            self._free = asyncio.Queue()
            for i in range(self.cfg.workers):
                self._free.put_nowait(SandboxRunner(self.cfg, i, unsandboxed=self.unsandboxed))
        return self._free

    async def run(
        self, code: str, stdin: str = "", files: dict[str, str] | None = None, secret: bytes | None = None
    ) -> ExecResult:
        """Execute `code` (as main.py, with `stdin` and `files`) once a worker is free; `secret` is
        readable once from fd `SECRET_FD` (see `SandboxRunner.run`)."""
        if not self._checked:
            await asyncio.to_thread(self.check)
        slots = self._slots()
        runner = await slots.get()
        try:
            res = await runner.run(code, stdin, files, secret)
        finally:
            slots.put_nowait(runner)
        self.counts[res.status.value] += 1
        self.exec_s += res.wall_s
        return res

    def metrics(self) -> dict[str, float]:
        """Execution counts by status and the mean wall time per execution."""
        n = sum(self.counts.values())
        out = {f"sandbox/{k}": float(v) for k, v in self.counts.items()}
        out["sandbox/executions"] = float(n)
        out["sandbox/mean_exec_s"] = self.exec_s / n if n else 0.0
        return out

    async def close(self) -> None:
        """Nothing outlives an execution; this drops the slots (kept for symmetry with tools)."""
        self._free = None
