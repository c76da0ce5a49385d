"""The reverse-digits reward, re-exported for the distillation example (same task, same reward).

`verst train` puts the config's folder on `sys.path`; the reward lives next to the
reverse-digits example, so it is loaded from there by file path.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "reverse_digits_reward",
    Path(__file__).resolve().parent.parent / "reverse_digits" / "reverse_digits_reward.py",
)
assert _spec is not None and _spec.loader is not None
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)

reward = _module.reward
"""Partial credit over digits + EOS (see examples/reverse_digits/reverse_digits_reward.py)."""
