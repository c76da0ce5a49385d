"""The README's command one, in full: `verst train examples/reverse_digits/config.toml`.

Slow (about 3–5 minutes on 2 CPU cores): run with `uv run pytest -m slow tests/e2e`.
Checks the promise of the example — held-out greedy eval reward rises by at least 0.3 over
the shipped warm start, within 10 minutes — through the same entry point users call.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from verst.trainer.cli import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reverse_digits"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_example_raises_eval_reward_by_at_least_0_3_within_10_minutes(tmp_path, capsys):
    run = tmp_path / "run"
    start = time.monotonic()
    code = main(["train", str(EXAMPLE / "config.toml"), f'run.output_dir="{run}"'])
    elapsed = time.monotonic() - start
    assert code == 0, capsys.readouterr().err
    summary = json.loads((run / "summary.json").read_text())
    print(
        f"eval {summary['initial_eval_reward']:.3f} -> {summary['final_eval_reward']:.3f} in {elapsed:.0f}s"
    )
    assert summary["initial_eval_reward"] == pytest.approx(0.384, abs=0.02)  # the shipped warm start
    assert summary["final_eval_reward"] - summary["initial_eval_reward"] >= 0.3
    assert elapsed < 600
    assert (run / "curves.png").exists()
