"""The bubblewrap command line of one execution, and the check that bwrap works here.

The sandbox sees, read-only: /usr (and the /bin, /lib, /lib64, /sbin links or dirs), the
interpreter's prefix, a few /etc files the loader needs, and the execution's own input folder
at /in; a fresh tmpfs at /work (size-capped, its working directory); /dev, /proc; nothing else.
All namespaces are new (no network but its own loopback, its own pids, ipc, uts); the root is
remounted read-only; it dies with its parent and runs in a new session.

Where the host runs as root, the user namespace would map the code to host uid 0, for which
the kernel ignores RLIMIT_NPROC: so then bwrap keeps only CAP_SETUID/CAP_SETGID, creates no user
namespace, and the launcher drops to a per-worker uid (`uid_base + worker`) with no capabilities
before any user code runs. As a normal user bwrap makes a user namespace (`--unshare-user`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from verst.rollout.sandbox.config import SandboxConfig

INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap)"
"""What to do when bwrap is missing or cannot create namespaces."""

WORKDIR = "/work"
"""The working directory inside the sandbox (a fresh tmpfs)."""

INDIR = "/in"
"""Where the execution's input folder (main.py, files, stdin) is bound read-only."""

_ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/nsswitch.conf")
"""The only /etc files bound: the dynamic loader's cache and time zone."""


def host_python(configured: str = "") -> str:
    """The interpreter to run inside: `configured`, or the real file behind `sys.executable`
    (a venv's python resolves to its base interpreter, whose prefix is then bound)."""
    if configured:
        return str(Path(configured).resolve())
    base = getattr(sys, "_base_executable", "") or sys.executable
    return str(Path(base).resolve())


def python_prefix(python: str) -> str:
    """The installation prefix of `python` (`<prefix>/bin/python3.x`)."""
    return str(Path(python).parent.parent)


@dataclass(frozen=True, slots=True)
class BwrapPlan:
    """What `bwrap_argv` needs beyond the config: the host's input folder and the worker's uid."""

    indir: str
    """Host folder bound at /in (main.py, files/, stdin)."""
    uid: int | None
    """The uid the launcher drops to (host root only), else None."""


def _root_binds(prefix: str, extra: list[str]) -> list[str]:
    """--ro-bind / --symlink arguments for /usr, the top-level links, /etc files and the prefix."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for path in _ETC_FILES:
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    for path in [prefix, *extra]:
        if path.startswith("/usr/") or path == "/usr":
            continue
        args += [*_parents(path), "--ro-bind", path, path]
    return args


def _parents(path: str) -> list[str]:
    """--dir arguments (mode 0755) for the parents of `path`, so a dropped uid can traverse them."""
    args: list[str] = []
    parts = Path(path).parts[1:-1]
    for i in range(len(parts)):
        args += ["--perms", "0755", "--dir", "/" + "/".join(parts[: i + 1])]
    return args


def bwrap_argv(cfg: SandboxConfig, plan: BwrapPlan, inner: list[str]) -> list[str]:
    """The full bwrap command line running `inner` (the launcher) inside the sandbox."""
    python = host_python(cfg.python)
    if plan.uid is not None:
        ns = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        ns += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        ns = ["--unshare-all", "--unshare-user"]
    work_bytes = 4 * cfg.limits.file_size_mb << 20
    return [
        cfg.bwrap,
        *ns,
        "--die-with-parent",
        "--new-session",
        *_root_binds(python_prefix(python), cfg.extra_ro_binds),
        "--perms",
        "0755",
        "--dir",
        INDIR,
        "--ro-bind",
        plan.indir,
        INDIR,
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--size",
        str(work_bytes),
        "--perms",
        "1777",
        "--tmpfs",
        WORKDIR,
        "--size",
        str(work_bytes),
        "--perms",
        "1777",
        "--tmpfs",
        "/tmp",
        "--chdir",
        WORKDIR,
        "--remount-ro",
        "/",
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/local/bin:/usr/bin:/bin",
        "--setenv",
        "HOME",
        WORKDIR,
        "--setenv",
        "PYTHONDONTWRITEBYTECODE",
        "1",
        "--setenv",
        "LANG",
        "C.UTF-8",
        "--",
        *inner,
    ]
