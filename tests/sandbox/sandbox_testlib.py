"""Shared pieces of the sandbox tests: a pool with small limits, checked (`bwrap_testlib`: skip
with the install line where bwrap cannot sandbox, fail under `VERST_REQUIRE_BWRAP=1`), and the
host-side checks (no process left behind, no temp folder left, host files unchanged).
"""

from __future__ import annotations

import glob
import os

from bwrap_testlib import checked_pool

from verst.rollout.sandbox import SandboxConfig, SandboxLimits

__all__ = ["checked_pool"]  # (bwrap_testlib: the skip-or-fail rule, shared with conftest.bwrap_ok)

UID_BASE = 62100
"""Sandbox uids of the tests (host root only): processes of these uids are sandbox processes."""
WORKERS = 2


def small_config(tmp_dir: str = "", **limits: float) -> SandboxConfig:
    """Small limits, so hostile programs end fast: 1 CPU second, 256 MB, 32 processes, 16 MB files."""
    base = dict(
        cpu_s=1,
        memory_mb=256,
        processes=32,
        file_size_mb=16,
        open_files=64,
        wall_s=3.0,
        max_output_bytes=64 << 10,
    )
    base.update(limits)
    return SandboxConfig(limits=SandboxLimits(**base), workers=WORKERS, uid_base=UID_BASE, tmp_dir=tmp_dir)


def _children(root: int) -> set[int]:
    """Every live descendant of `root` (walking /proc's parent links)."""
    parents: dict[int, int] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(stat.split("/")[2])] = int(fields[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def _sandbox_uid_pids() -> set[int]:
    """Live processes owned by the tests' sandbox uids (they can only come from a sandbox)."""
    uids = {str(UID_BASE + i) for i in range(WORKERS)}
    pids = set()
    for status in glob.glob("/proc/[0-9]*/status"):
        try:
            with open(status) as f:
                text = f.read()
        except OSError:
            continue
        uid_line = next((ln for ln in text.splitlines() if ln.startswith("Uid:")), "")
        state = next((ln for ln in text.splitlines() if ln.startswith("State:")), "")
        if uid_line.split()[1:2] and uid_line.split()[1] in uids and " Z " not in state + " ":
            pids.add(int(status.split("/")[2]))
    return pids


def leftover_processes() -> set[int]:
    """Processes a sandbox left: our live descendants plus anything of the sandbox uids."""
    return _children(os.getpid()) | _sandbox_uid_pids()


def leftover_temp(tmp_dir: str) -> list[str]:
    """Input folders of executions still on the host."""
    return glob.glob(os.path.join(tmp_dir, "verst-sandbox-*"))
