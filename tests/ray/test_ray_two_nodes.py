"""`verst train` joins a two-node Ray cluster started with `ray start` on this one machine (issue
25, item 26), the placement code's multi-node test.

Real `ray start` processes: a head (`--head --node-ip-address=127.0.0.1 --port=P`) and a worker
node joining it (`--address=127.0.0.1:P --node-ip-address=127.0.0.1`), 2 logical CPUs each, then
`verst train ... run.placement=ray run.ray_address=127.0.0.1:P` as a subprocess (the CLI's own
join path). The train bundle (2 CPUs) and the rollout manager (2 CPUs) cannot share a node, so
the run must use both: the actors' logs name two node ids. The run ends cleanly (exit 0, a
checkpoint, no ERROR line, the rollout side closed). The Ray processes are stopped by their
`ray start --block` parents (SIGTERM), leftovers of this cluster by PID.

Ray 2.60 on Linux keeps clusters enabled (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` unset): a worker
node refuses to start with it off. The nodes then register the machine's interface address even
when given 127.0.0.1; the GCS listens on every interface, so the loopback address still joins
(docs/placement.md, "Two nodes on one machine").
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil  # a dependency of Ray
import pytest
from ray_testlib import shutdown_problems, write_prompts

from verst.trainer.placement.ray_join import reachable

RAY = str(Path(sys.executable).with_name("ray"))
NODE_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0"}
CONFIG = """
[run]
num_steps = 1
seed = 0
save_interval = 1
placement = "ray"

[run.ray]
device = "cpu"
layout = "disaggregated"
num_train_actors = 1
cpus_per_train_actor = 2
rollout_num_cpus = 2

[engine]
type = "embedded"
device = "cpu"
num_threads = 1

[train]
model_path = "{model}"
lr = 1e-3
micro_batch_size = 4
num_threads = 1

[rollout]
batch_size = 2
n_samples_per_prompt = 2
max_response_len = 4
seed = 7

[rollout.data]
path = "{data}"

[rollout.reward]
type = "exact_match"
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node(args: list[str], temp: str, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | NODE_ENV
    cmd = [RAY, "start", "--block", "--num-cpus=2", "--disable-usage-stats", f"--temp-dir={temp}", *args]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _wait_started(proc: subprocess.Popen, log: Path, what: str, timeout_s: float = 150) -> None:
    deadline = time.monotonic() + timeout_s
    while "Ray runtime started" not in log.read_text():
        assert proc.poll() is None, f"the {what} exited: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, (
            f"the {what} did not start in {timeout_s:.0f} s: {log.read_text()[-2000:]}"
        )
        time.sleep(0.5)


def _stop(procs: list[subprocess.Popen], temp: str) -> None:
    """SIGTERM each `ray start --block` (it stops its node's processes), then SIGKILL by PID
    whatever of this cluster is left (its processes name its temp dir)."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
    for p in psutil.process_iter(["pid", "cmdline"]):
        if any(temp in part for part in p.info["cmdline"] or []):
            with contextlib.suppress(psutil.Error):
                p.kill()


# opt-in (`uv run pytest -m multinode tests/ray`), not in .ci/run: Ray 2.60's multi-node mode
# registers the machine's interface address and its GCS listens on every interface, and the
# project's processes listen on 127.0.0.1 only; ~140 s under load 3
@pytest.mark.slow
@pytest.mark.multinode
@pytest.mark.timeout(420)
def test_verst_train_joins_a_two_node_loopback_cluster_and_uses_both_nodes(tmp_path, tiny_checkpoint):
    temp = tempfile.mkdtemp(prefix="vr2n-", dir="/tmp")  # short: Ray's socket paths have a length limit
    port = _port()
    procs: list[subprocess.Popen] = []
    try:
        head_log, worker_log = tmp_path / "head.log", tmp_path / "worker.log"
        procs.append(
            _node(
                ["--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--include-dashboard=false"],
                temp,
                head_log,
            )
        )
        _wait_started(procs[0], head_log, "head")
        assert reachable("127.0.0.1", port), "the head's GCS does not answer on loopback"
        procs.append(_node([f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1"], temp, worker_log))
        _wait_started(procs[1], worker_log, "worker node")

        data = write_prompts(tmp_path / "prompts.jsonl")
        config = tmp_path / "config.toml"
        config.write_text(CONFIG.format(model=tiny_checkpoint, data=data))
        run_dir = tmp_path / "run"
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | NODE_ENV
        cmd = [sys.executable, "-m", "verst.trainer.cli", "train", str(config), f"run.output_dir={run_dir}"]
        cmd += [f"run.ray_address=127.0.0.1:{port}"]
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

        logs = {p.name: p.read_text() for p in (run_dir / "logs" / "actors").glob("*.log")}
        nodes = {m for text in logs.values() for m in re.findall(r"runs on node ([0-9a-f]{16,})", text)}
        assert len(nodes) == 2, f"the actors ran on {len(nodes)} node(s): {nodes}"
        assert (run_dir / "checkpoints" / "step_1").is_dir()
        assert shutdown_problems(run_dir) == []
    finally:
        _stop(procs, temp)
        shutil.rmtree(temp, ignore_errors=True)
