"""`verst-rollout-legacy` is installable on its own: its wheel plus rollout-core's, nothing else.

Builds both wheels with `uv build`, installs just those two into a fresh virtual environment
(their registry dependencies, pydantic and aiohttp, come along; no torch, no trainer, no
kernels), and runs a legacy rollout there against a trivial in-script engine — through the
`LegacyRolloutStrategy` and through the bare v1 call `generate_rollout(args, rollout_id,
data_source)`. Slow (builds and installs): `uv run pytest -m slow tests/legacy`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import asyncio
    import importlib.util
    import sys

    for absent in ("torch", "transformers", "verst.trainer", "verst.kernels"):
        assert importlib.util.find_spec(absent) is None, f"{absent} must not be installed here"

    from verst.rollout.config import RolloutConfig
    from verst.rollout.engine import GenerateOutput
    from verst.rollout.lifecycle import ListSink
    from verst.rollout.protocols import RolloutContext, RolloutRequest
    from verst.rollout.sample import Sample
    from verst.rollout_legacy import LegacyRolloutStrategy, generate_rollout


    class Tok:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

        def decode(self, ids):
            return "".join(chr(i) for i in ids)


    class Engine:
        async def generate(self, request):
            n = request.sampling.max_new_tokens
            ids = [97 + (len(request.input_ids) + i) % 26 for i in range(n)]
            return GenerateOutput(ids, [-0.5] * n, "length", 0, len(request.input_ids))

        async def abort(self, rid_prefix=None):
            pass

        async def get_weight_version(self):
            return 0

        async def health(self):
            return True

        async def close(self):
            pass


    class Data:
        def __init__(self):
            self.offset, self.buffer = 0, []

        def get_samples(self, num_groups):
            out = []
            for _ in range(num_groups):
                self.offset += 1
                out.append([Sample(prompt="q" * self.offset, label="b") for _ in range(2)])
            return out

        def add_samples(self, groups):
            self.buffer.extend(groups)

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass


    async def reward(sample):
        return float(sample.response.startswith("b"))


    config = RolloutConfig(batch_size=3, n_samples_per_prompt=2, max_response_len=5)
    ctx = RolloutContext(config=config, data_source=Data(), engine=Engine(), tokenizer=Tok(),
                         reward_fn=reward, sink=ListSink())
    strategy = LegacyRolloutStrategy(ctx)
    result = asyncio.run(strategy(RolloutRequest(rollout_id=0)))
    assert len(result.groups) == 3 and all(len(g) == 2 for g in result.groups), result.groups
    for group in result.groups:
        for s in group:
            s.validate()
            assert s.response_length == 5 and len(s.rollout_logprobs) == 5 and s.reward is not None
    kinds = [e.kind.value for e in ctx.sink.events]
    assert kinds.count("attempt_start") == kinds.count("attempt_end") == 6, kinds

    out = generate_rollout(strategy.args, 1, ctx.data_source)
    assert len(out.samples) == 3

    for heavy in ("torch", "transformers", "verst.trainer", "verst.kernels"):
        assert heavy not in sys.modules, f"{heavy} was imported"
    print("LEGACY_WHEEL_OK", len(result.groups), result.metrics["rollout/kept_groups"])
    """
)


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_legacy_wheel_installs_and_runs_without_trainer_or_kernels(tmp_path):
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH (the CI script installs it)")
    dist = tmp_path / "dist"
    for package in ("verst-rollout-core", "verst-rollout-legacy"):
        _run([uv, "build", "--wheel", "--package", package, "--out-dir", str(dist)], REPO)
    wheels = sorted(dist.glob("*.whl"))
    assert [w.name.split("-")[0] for w in wheels] == ["verst_rollout_core", "verst_rollout_legacy"]

    legacy_wheel = wheels[1]
    with zipfile.ZipFile(legacy_wheel) as zf:
        names = zf.namelist()
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    requires = [
        line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")
    ]
    assert requires == ["verst-rollout-core"], requires
    assert not any(n.startswith("verst/__init__") for n in names), "verst must stay a PEP 420 namespace"

    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    _run([uv, "venv", "--python", f"{sys.version_info.major}.{sys.version_info.minor}", str(venv)], tmp_path)
    _run([uv, "pip", "install", "--python", str(python), *map(str, wheels)], tmp_path)
    listed = _run([uv, "pip", "list", "--python", str(python)], tmp_path).stdout.lower()
    for forbidden in ("torch", "verst-trainer", "verst-kernels", "transformers"):
        assert forbidden not in listed, listed
    script = tmp_path / "run_legacy.py"
    script.write_text(SCRIPT)
    proc = _run([str(python), str(script)], tmp_path)
    assert "LEGACY_WHEEL_OK 3 3.0" in proc.stdout, proc.stdout + proc.stderr
