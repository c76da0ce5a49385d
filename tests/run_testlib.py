"""Pieces shared by the tests that run whole trainings (trainer, Ray, fully-async): a prompt
file and a reward module a tiny random model's samples differ on.

`tests/` is on `sys.path` for every test (pytest inserts the directory of the root
`conftest.py`), so any test folder imports this as `run_testlib`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REWARD_MODULE = '''
def digit_fraction(sample):
    """Fraction of digit characters in the response: varies across samples of a tiny random model."""
    text = sample.response
    return sum(c.isdigit() for c in text) / max(1, len(text))
'''


def write_prompts(path: Path, n: int) -> Path:
    """A JSONL file of n addition prompts with labels."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"prompt": f"{i}+{i + 1}=", "label": str(2 * i + 1)}) + "\n")
    return path


def install_reward_module(tmp_path: Path, monkeypatch: Any, module: str) -> str:
    """Write `REWARD_MODULE` as `<tmp_path>/<module>.py` and put it on sys.path (Ray actors get
    the driver's import path); returns the reward's import path."""
    (tmp_path / f"{module}.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{module}:digit_fraction"
