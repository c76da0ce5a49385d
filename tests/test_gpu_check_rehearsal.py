"""The CPU rehearsal of `scripts/gpu_check.py` (issue 25, item 22).

The script runs here as it runs on a lent GPU machine: this interpreter, PYTHONPATH set by the
script to the packages' `src` folders, verst's installed dist metadata hidden from
`importlib.metadata` during the import check, nothing installed. On a machine without CUDA the
env stage runs (versions, every verst module imports, the tiny model is saved) and every CUDA
stage SKIPs with the reason. Every declared check prints exactly one PASS/FAIL/SKIP line, and
OUT holds at most 6 files.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _stages():
    spec = importlib.util.spec_from_file_location("gpu_check_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.STAGES


@pytest.mark.timeout(220)
def test_gpu_check_rehearsal_on_cpu_reports_every_check_once_and_writes_at_most_6_files(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: run scripts/gpu_check.sh itself")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["OUT"] = str(out)  # honoured when --out is not given
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--budget-scale", "3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    lines = result.stdout.splitlines()
    for stage in _stages():
        for name in stage.checks:
            mine = [line for line in lines if re.match(rf"(PASS|FAIL|SKIP) {re.escape(name)}: \S", line)]
            assert len(mine) == 1, f"{name}: {mine or 'no line'}\n{result.stdout[-3000:]}"
            status = mine[0].split()[0]
            if stage.name == "env":
                want = "SKIP" if name == "env/cuda_device" else "PASS"
                assert status == want, f"{mine[0]}\n{(out / 'gpu_check.log').read_text()[-3000:]}"
            else:  # every other stage needs CUDA
                assert status == "SKIP" and "no CUDA device" in mine[0], mine[0]
    assert result.returncode == 0, result.stdout[-2000:]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 1 <= len(files) <= 6, files
    summary = (out / "summary.txt").read_text().splitlines()
    checks = sum(len(s.checks) for s in _stages())
    assert len(summary) == checks + 1 and summary[-1].startswith("gpu_check: ") and "0 failed" in summary[-1]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == checks + 1 and records[-1]["facts"]["cuda"] is False
    assert records[-1]["facts"]["import_errors"] and not any(records[-1]["facts"]["import_errors"].values())
