"""The tool of the tool-math example: exact multiplication, which the tiny model cannot do.

`[rollout.env.options] tools = ["tools:multiply"]` (the config's folder is on `sys.path`).
"""

from __future__ import annotations


def multiply(a: int, b: int) -> int:
    """Multiply two integers exactly.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return int(a) * int(b)
