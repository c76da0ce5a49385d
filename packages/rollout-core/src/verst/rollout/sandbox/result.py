"""`ExecResult` and `ExecStatus`: what one execution in the sandbox gave."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ExecStatus(enum.StrEnum):
    """How an execution ended; rewards count samples by it."""

    OK = "ok"
    """Exit code 0."""
    ERROR = "error"
    """A non-zero exit code (an exception, a failed assert, `sys.exit(1)`)."""
    SYNTAX_ERROR = "syntax_error"
    """The code does not compile; nothing ran."""
    TIMEOUT = "timeout"
    """Wall-clock timeout; the sandbox was killed."""
    KILLED = "killed"
    """Ended by a signal (the CPU limit's SIGXCPU/SIGKILL, a memory error's abort, its own kill)."""
    OUTPUT_LIMIT = "output_limit"
    """More than `max_output_bytes` on stdout or stderr; the sandbox was killed."""
    SANDBOX_ERROR = "sandbox_error"
    """The sandbox itself failed to start (bwrap's own error is in stderr)."""


@dataclass(frozen=True, slots=True)
class ExecResult:
    """One execution: its status, exit code, captured output (capped) and timing."""

    status: ExecStatus
    """How it ended."""
    exit_code: int | None
    """The exit code; negative for a signal; None when it was killed by the runner."""
    stdout: str
    """Captured stdout, at most `max_output_bytes`, decoded with errors="replace"."""
    stderr: str
    """Captured stderr, likewise."""
    stdout_truncated: bool = False
    """Whether stdout was cut at the cap."""
    stderr_truncated: bool = False
    """Whether stderr was cut at the cap."""
    wall_s: float = 0.0
    """Seconds from start to end, the sandbox's own setup included."""

    @property
    def ok(self) -> bool:
        """Exit code 0."""
        return self.status is ExecStatus.OK
