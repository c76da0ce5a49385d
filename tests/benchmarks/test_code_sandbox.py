"""`benchmarks/code_sandbox.py` runs end to end on a small setting (real bwrap) and ends with its
`key=value` line; the numbers themselves are the benchmark's, not this test's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sandbox"))
from sandbox_testlib import checked_pool, small_config

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "code_sandbox.py"


@pytest.mark.timeout(180)
def test_the_benchmark_prints_its_three_numbers():
    checked_pool(small_config())  # skip (or fail under VERST_REQUIRE_BWRAP=1) without bwrap
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--execs", "3", "--episodes", "4", "--concurrency", "2"],
        capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    last = done.stdout.strip().splitlines()[-1]
    m = re.fullmatch(
        r"sandbox_execs_per_s=([\d.]+) sandbox_overhead_ms=(-?[\d.]+) tool_wait_overlap=([\d.]+)", last
    )
    assert m, last
    assert float(m.group(1)) > 0 and float(m.group(3)) > 0
