"""`launch_router` returns only once the router lists every worker it was given (issue 25,
item 20): sglang-router 0.3.x answers `/readiness` 200 as soon as one worker is healthy, so the
launcher also polls `GET /workers` until all expected workers appear (or fails naming those
missing).

sglang-router is not installed on CPU boxes: `standin_router/sglang_router/launch_router.py`
stands in for it (a real HTTP process started by the real launcher, ready with one worker and
listing the second 1.5 s later). The workers are URLs only: the router never calls them here.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from verst.rollout.engine import EngineError
from verst.rollout.engines.sglang.launcher import free_port, launch_router

STANDIN = Path(__file__).resolve().parent / "standin_router"


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.syspath_prepend(str(STANDIN))  # `require("sglang_router")` finds the stand-in
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(STANDIN), os.environ.get("PYTHONPATH", "")])}


def test_launch_router_waits_until_every_worker_is_listed(standin, tmp_path):
    workers = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    started = time.monotonic()
    router = launch_router(workers, ready_timeout_s=60, env=standin, log_dir=tmp_path)
    try:
        import json
        import urllib.request

        with urllib.request.urlopen(router.url + "/workers", timeout=5) as resp:
            listed = [w["url"] for w in json.loads(resp.read())["workers"]]
        assert listed == workers, "launch_router returned before the router listed every worker"
        assert time.monotonic() - started >= 1.5
    finally:
        router.stop()


def test_a_worker_never_listed_fails_naming_it(standin, tmp_path, monkeypatch):
    import verst.rollout.engines.sglang.launcher as launcher

    monkeypatch.setattr(launcher, "ROUTER_WORKERS_WAIT_S", 3.0)
    workers = [f"http://127.0.0.1:{free_port()}"]
    # the stand-in lists worker_urls[:1] first; a second expected URL it was never given stays missing
    missing = f"http://127.0.0.1:{free_port()}"
    proc = launcher._spawn(
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--port",
            str(port := free_port()),
            "--worker-urls",
            *workers,
        ],
        f"http://127.0.0.1:{port}",
        tmp_path,
        "router",
        standin,
    )
    try:
        launcher.wait_ready(proc, 60, path="/readiness")
        with pytest.raises(EngineError, match=missing.replace(".", r"\.")):
            launcher.wait_router_workers(proc, [*workers, missing], launcher.ROUTER_WORKERS_WAIT_S)
    finally:
        proc.stop()
