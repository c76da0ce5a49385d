"""The README's command one, in full: `verst train examples/reverse_digits/config.toml` — and
the same promise for the MoE example with routing replay (`examples/moe_digits`).

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

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
WARM_START_EVAL = {"reverse_digits": 0.384, "moe_digits": 0.297}
"""Each example's shipped warm start: its greedy held-out eval reward."""


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("example", sorted(WARM_START_EVAL))
def test_example_raises_eval_reward_by_at_least_0_3_within_10_minutes(example, tmp_path, capsys):
    run = tmp_path / "run"
    start = time.monotonic()
    code = main(["train", str(EXAMPLES / example / "config.toml"), f'run.output_dir="{run}"'])
    elapsed = time.monotonic() - start
    assert code == 0, capsys.readouterr().err
    summary = json.loads((run / "summary.json").read_text())
    print(
        f"eval {summary['initial_eval_reward']:.3f} -> {summary['final_eval_reward']:.3f} in {elapsed:.0f}s"
    )
    assert summary["initial_eval_reward"] == pytest.approx(WARM_START_EVAL[example], abs=0.02)
    assert summary["final_eval_reward"] - summary["initial_eval_reward"] >= 0.3
    assert elapsed < 600
    assert (run / "curves.png").exists()
