"""`SandboxConfig`: the limits and the pool size of the code sandbox (see docs/code.md).

The reward `code_tests` and the agentic `python` tool both take one of these. Defaults suit a
test suite of a short function: 5 CPU seconds, 512 MB of address space, 64 processes, 16 MB
per file, 10 s of wall time.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SandboxLimits(BaseModel):
    """Resource limits of one execution (rlimits inside the sandbox plus a wall-clock timeout)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    cpu_s: float = Field(5.0, gt=0, description="CPU seconds (RLIMIT_CPU) of each process in the sandbox.")
    memory_mb: int = Field(512, gt=0, description="Address space per process in MB (RLIMIT_AS).")
    processes: int = Field(64, gt=0, description="Processes and threads the sandbox may hold (RLIMIT_NPROC).")
    file_size_mb: int = Field(
        16, gt=0, description="Largest file in MB (RLIMIT_FSIZE); the working tmpfs holds 4x this in all."
    )
    open_files: int = Field(64, ge=16, description="Open file descriptors per process (RLIMIT_NOFILE).")
    wall_s: float = Field(10.0, gt=0, description="Wall-clock timeout; then the whole sandbox is killed.")
    max_output_bytes: int = Field(
        1 << 20, gt=0, description="Bytes of stdout and of stderr kept; more kills the run (`output_limit`)."
    )


class SandboxConfig(BaseModel):
    """How code runs: bubblewrap, its limits, the interpreter, and how many run at once."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    limits: SandboxLimits = Field(default_factory=SandboxLimits, description="Limits of each execution.")
    workers: int = Field(2, gt=0, description="Executions that run at once (the pool's bound).")
    python: str = Field(
        "",
        description="Interpreter inside the sandbox; empty: the host interpreter behind sys.executable "
        "(its prefix is bound read-only).",
    )
    bwrap: str = Field("bwrap", description="The bubblewrap executable (Debian package `bubblewrap`).")
    uid_base: int = Field(
        61000, gt=0, description="When the host runs as root, worker i runs code as uid uid_base + i."
    )
    extra_ro_binds: list[str] = Field(
        default_factory=list, description="More host paths bound read-only at the same place."
    )
    tmp_dir: str = Field(
        "", description="Host folder for each execution's input folder (empty: the system temp folder)."
    )
    allow_unsandboxed: bool = Field(
        False,
        description="Run code as a plain subprocess with rlimits where bwrap cannot work. Unsafe: "
        "untrusted code can then read and write the host; every log line says so.",
    )
