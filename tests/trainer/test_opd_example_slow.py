"""The distillation example: OPD's held-out eval reward rises faster than GRPO alone (slow)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_opd_beats_grpo_at_the_same_number_of_samples(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "opd_vs_grpo.py"),
            "--steps",
            "40",
            "--output-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("opd_minus_grpo_eval=")
    assert float(last.split("=")[1]) > 0.02, out.stdout
