"""Running untrusted Python in a bubblewrap sandbox (docs/code.md).

`SandboxPool(SandboxConfig())` bounds how many run at once; `await pool.run(code, stdin, files)`
returns an `ExecResult`; `pool.check()` raises `SandboxUnavailable` with one line saying what to
install where bwrap is missing or cannot create namespaces.
"""

from verst.rollout.sandbox.config import SandboxConfig, SandboxLimits
from verst.rollout.sandbox.launcher import SECRET_FD
from verst.rollout.sandbox.pool import SandboxPool, SandboxUnavailable
from verst.rollout.sandbox.result import ExecResult, ExecStatus
from verst.rollout.sandbox.runner import SandboxError, SandboxRunner

__all__ = [
    "SECRET_FD",
    "ExecResult",
    "ExecStatus",
    "SandboxConfig",
    "SandboxError",
    "SandboxLimits",
    "SandboxPool",
    "SandboxRunner",
    "SandboxUnavailable",
]
