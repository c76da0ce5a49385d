"""One Ray cluster for every test under tests/ray (starting one takes seconds).

Token authentication (on by default for local clusters since Ray 2.59) is turned off with
`RAY_AUTH_MODE=disabled`, Ray's `uv run` hook with `RAY_ENABLE_UV_RUN_RUNTIME_ENV=0`, and the
session lives in a short temporary directory (Ray's socket paths have a length limit). The
legacy-rollout flag is removed while the cluster starts, so no worker inherits a developer's
shell value. The cluster is started by verst's own `connect` (no address: a local cluster, on
loopback only — node IP and GCS on 127.0.0.1).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

LEGACY_FLAG = "VERST_USE_LEGACY_ROLLOUT_V1"
RAY_SETTINGS = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
NAMESPACE = "verst-tests"


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster with 4 logical CPUs (actors mostly wait on each other)."""
    saved = {k: os.environ.get(k) for k in [*RAY_SETTINGS, LEGACY_FLAG]}
    os.environ.update(RAY_SETTINGS)
    os.environ.pop(LEGACY_FLAG, None)
    from verst.trainer.placement.ray_cluster import connect

    temp = tempfile.mkdtemp(prefix="vray-", dir="/tmp")
    try:
        conn = connect(
            None, namespace=NAMESPACE, min_cpus=4, init_options={"_temp_dir": temp, "log_to_driver": False}
        )
    finally:
        for key, value in saved.items():
            if key in RAY_SETTINGS:
                continue
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    import ray

    yield ray
    conn.close()
    for key in RAY_SETTINGS:
        if saved[key] is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved[key]
    shutil.rmtree(temp, ignore_errors=True)
