"""Joining or starting a Ray cluster, and the runtime environment every actor gets.

`connect(address)`: with an address (`"auto"`, `"HOST:6379"`) it joins that cluster
(`ray.init(address=...)`); without one it starts a local cluster in this process, on loopback
only (node IP and GCS on 127.0.0.1, see `LOOPBACK_ENV`). If Ray is already initialised (a
notebook, a test session), that connection is reused and left open.

The runtime environment of every actor is the run's effective environment
(`verst.rollout.selection.resolve_extra_env_vars`) as `{"env_vars": ...}`, minus variables that
describe one machine or one process (PATH, HOME, CUDA_VISIBLE_DEVICES, RANK, RAY_*...), which
Ray and the node set themselves. Variables set in the config (`run.env`) are always forwarded.
The legacy-rollout flag is always pinned (to "0" when unset), so an actor never inherits a value
from the shell that started a Ray node.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from verst.rollout.errors import MissingOptionalDependency
from verst.rollout.selection import LEGACY_FLAG
from verst.trainer.placement.ray_join import LOOPBACK, LOOPBACK_ENV

RAY_INSTALL_HINT = "`uv sync` (ray is a dependency of verst-trainer) or `pip install 'ray>=2.40'`"
"""How to install Ray."""

MACHINE_LOCAL_VARS = frozenset(
    {
        "PATH",
        "HOME",
        "PWD",
        "OLDPWD",
        "SHELL",
        "USER",
        "LOGNAME",
        "HOSTNAME",
        "TERM",
        "SHLVL",
        "_",
        "TMPDIR",
        "VIRTUAL_ENV",
        "PYTHONHOME",
        "LD_LIBRARY_PATH",
        "LD_PRELOAD",
        "CUDA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "OMP_NUM_THREADS",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)
"""Ambient variables never forwarded to actors: they belong to one machine or one process."""
MACHINE_LOCAL_PREFIXES = ("RAY_", "TORCHELASTIC_", "SLURM_", "PYTEST_", "UV_", "SSH_", "XDG_")
"""Prefixes of ambient variables never forwarded (Ray's own settings, launchers, test runners)."""


def require_ray(
    *, local_cluster: bool = False, join: str | None = None, probe_s: float | None = None
) -> ModuleType:
    """Import Ray, or raise `MissingOptionalDependency` with the install command.

    Ray's `uv run` hook (re-running `uv run` and uploading the working directory for every worker)
    is turned off unless the user set `RAY_ENABLE_UV_RUN_RUNTIME_ENV`: verst's actors run the
    driver's interpreter, on this machine or on nodes with the same image. `local_cluster`: this
    process will start a local cluster, which must stay on loopback (`LOOPBACK_ENV`, unless the
    user set it; it only takes effect if Ray is not imported yet — `connect` checks the result).
    `join`: this process will join the cluster at that address; it is probed first
    (`ray_join.join_settings`: an unreachable address fails within `probe_s`, default a minute,
    and a loopback-only head gets the loopback setting).
    """
    import os
    import sys

    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    if join:
        from verst.trainer.placement.ray_join import JOIN_PROBE_S, join_settings

        wait = JOIN_PROBE_S if probe_s is None else probe_s
        for key, value in join_settings(join, probe_s=wait, ray_imported="ray" in sys.modules).items():
            os.environ.setdefault(key, value)
    if local_cluster and "ray" not in sys.modules:
        for key, value in LOOPBACK_ENV.items():
            os.environ.setdefault(key, value)
    try:
        import ray
    except ModuleNotFoundError as exc:
        if exc.name == "ray" or (exc.name or "").startswith("ray."):
            raise MissingOptionalDependency(
                f"run.placement='ray' needs the package 'ray', which is not installed; install it with {RAY_INSTALL_HINT}"
            ) from exc
        raise
    return ray


def actor_env_vars(env: Mapping[str, str], explicit: Mapping[str, str] = ()) -> dict[str, str]:
    """The environment every actor gets: `env` minus machine-local variables, plus `explicit`
    (the config's `run.env`, always forwarded), with the legacy flag pinned."""
    out = {
        k: v
        for k, v in env.items()
        if k not in MACHINE_LOCAL_VARS and not k.startswith(MACHINE_LOCAL_PREFIXES)
    }
    out.update({str(k): str(v) for k, v in dict(explicit).items()})
    out.setdefault(LEGACY_FLAG, "0")
    return out


def runtime_env(env_vars: Mapping[str, str]) -> dict[str, Any]:
    """A Ray runtime env carrying exactly these variables."""
    return {"env_vars": dict(env_vars)}


@dataclass
class RayConnection:
    """This driver's connection to a Ray cluster."""

    address: str | None
    """The address joined (None = a local cluster started here, or a reused connection)."""
    started_here: bool
    """True when `connect` called `ray.init` (and `close` will call `ray.shutdown`)."""

    def cluster_gpus(self) -> float:
        """GPUs the cluster has in total."""
        return float(require_ray().cluster_resources().get("GPU", 0.0))

    def close(self) -> None:
        """Shut Ray down if this connection started it."""
        if self.started_here:
            ray = require_ray()
            if ray.is_initialized():
                ray.shutdown()
            self.started_here = False


def connect(
    address: str | None,
    *,
    namespace: str,
    min_cpus: float = 0.0,
    init_options: Mapping[str, Any] | None = None,
    probe_s: float | None = None,
) -> RayConnection:
    """Join the cluster at `address`, or start a local one; reuse an existing connection.

    A local cluster gets at least `min_cpus` logical CPUs (the plan's reservations) even on a
    machine with fewer cores: Ray's CPUs are scheduling units, and most actors mostly wait. It
    runs on loopback only; if Ray was imported before verst could pin that (`LOOPBACK_ENV`), the
    cluster is shut down again with an error saying how to fix it. `init_options` go to
    `ray.init` as they are (tests: `_temp_dir`, `log_to_driver`). Before joining `address` it is
    probed for up to `probe_s` (`verst.trainer.placement.ray_join`).
    """
    import math
    import os

    ray = require_ray(local_cluster=not address, join=address, probe_s=probe_s)
    if ray.is_initialized():
        return RayConnection(address=None, started_here=False)
    if address:
        ray.init(address=address, namespace=namespace, **dict(init_options or {}))
        return RayConnection(address=address, started_here=True)
    num_cpus = max(os.cpu_count() or 1, math.ceil(min_cpus))
    ray.init(namespace=namespace, include_dashboard=False, num_cpus=num_cpus, **dict(init_options or {}))
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOOPBACK:
        ray.shutdown()
        pin = " ".join(f"{k}={v}" for k, v in LOOPBACK_ENV.items())
        raise RuntimeError(
            f"the local Ray cluster registered its node on {node_ip}, not {LOOPBACK}: Ray was imported "
            f"before verst could keep it on loopback. Set {pin} in the environment before Ray is "
            "imported, or start a cluster yourself and give its address (run.ray_address)"
        )
    return RayConnection(address=None, started_here=True)


def free_port(host: str = "") -> int:
    """A TCP port free on `host` (default: every interface) right now (the train actors'
    rendezvous, on the node's IP)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
