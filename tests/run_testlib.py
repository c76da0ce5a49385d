"""Pieces shared by the tests that run whole trainings (trainer, Ray, fully-async): a prompt
file and a reward module a tiny random model's samples differ on.

`tests/` is on `sys.path` for every test (pytest inserts the directory of the root
`conftest.py`), so any test folder imports this as `run_testlib`.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from verst.trainer.run.controller import InMemoryLogger

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


class OnPhase(InMemoryLogger):
    """Runs `action` (in a thread, after `delay_s`) when the loop enters `phase` at step `step`."""

    def __init__(self, phase: str, step: int, action: Any, delay_s: float = 0.3) -> None:
        super().__init__()
        self.target, self.action, self.delay_s = (phase, step), action, delay_s
        self.step = 0
        self.fired_at: float | None = None
        """When the action ran (monotonic clock), once it did."""

    def log(self, step: int, metrics: Any) -> None:
        super().log(step, metrics)
        self.step = step

    def phase(self, name: str) -> None:
        super().phase(name)
        if (name, self.step) == self.target and self.fired_at is None:
            self.fired_at = time.monotonic() + self.delay_s
            threading.Timer(self.delay_s, self.action).start()
