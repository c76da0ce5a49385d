"""The tool of the multi-turn variant: run Python in the sandbox and return what it printed.

`[rollout.env.options] tools = ["tools:python"]` (the config's folder is on `sys.path`). The
example's own copy until the built-in `python` tool is on main.
"""

from __future__ import annotations

from verst.rollout.sandbox import SandboxConfig, SandboxRunner


async def python(code: str) -> str:
    """Run Python code in a sandbox and return its output.

    Args:
        code: the program; what it prints comes back.
    """
    result = await SandboxRunner(SandboxConfig()).run(code)
    if result.ok:
        return result.stdout
    return f"error ({result.status.value}): {result.stderr[-300:]}"
