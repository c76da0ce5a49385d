"""Checks before joining a Ray cluster at `run.ray_address`, so a join never hangs.

`ray.init(address="HOST:PORT")` retries the GCS every few seconds with no end when nothing
answers there. And for a loopback address (`127.0.0.1`, `localhost`) Ray 2.60 dials the
machine's interface address instead (`ray._private.services.resolve_ip_for_localhost`), so a
head whose servers listen on loopback only — one started with `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`,
the setting verst gives its own local clusters — is never reached.

`join_settings(address)` probes the address with plain TCP connects before Ray is involved:
- nothing accepts on HOST:PORT within `probe_s` (a head still starting gets that long) →
  `ConfigError` naming `run.ray_address`, the address and what to check;
- a loopback HOST that answers on loopback but not on the interface address Ray would dial →
  the loopback setting (`LOOPBACK_ENV`) must be in place before Ray is imported, which makes
  Ray keep 127.0.0.1 (returned for `require_ray` to set; if Ray is already imported without
  it, a `ConfigError` says so).
Addresses that are not HOST:PORT ("auto", "ray://...") are left to Ray.
"""

from __future__ import annotations

import socket
import time

from verst.rollout.errors import ConfigError, Problem

LOOPBACK = "127.0.0.1"
"""The one address a local cluster's node and GCS use."""

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Set before Ray is imported, this makes a local cluster's node IP 127.0.0.1. Without it Ray
(2.60) resolves the node IP — even an explicit `_node_ip_address="127.0.0.1"` or `ray start
--node-ip-address 127.0.0.1` — to the machine's interface address and registers the node and
the GCS there; with it the node IP is the loopback address and Ray's servers listen on it
(Ray's constant `ENABLE_RAY_CLUSTER`, read once when `ray` is imported; it only decides how the
local node IP is found, and that a `ray start` worker node may not join this cluster)."""

JOIN_PROBE_S = 60.0
"""How long a join waits for something to accept connections at `run.ray_address`."""
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def split_address(address: str) -> tuple[str, int] | None:
    """(host, port) of "HOST:PORT"; None for "auto", "local", "ray://..." and the like."""
    if "://" in address or ":" not in address:
        return None
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    return (host, int(port)) if port.isdigit() and host else None


def reachable(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether a TCP connection to host:port is accepted now."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def interface_ip() -> str | None:
    """The address Ray takes as this node's IP when clusters are enabled (the local end of a UDP
    socket pointed at a public address; nothing is sent), or None when there is no route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("8.8.8.8", 53))
            return str(s.getsockname()[0])
        except OSError:
            return None


def _unreachable(address: str, probe_s: float) -> ConfigError:
    return ConfigError(
        [
            Problem(
                "run.ray_address",
                f"cannot reach a Ray cluster at {address}: nothing accepted a connection there "
                f"within {probe_s:.0f} s",
                f"check that a Ray head runs there (`ray status --address {address}`), that the port "
                "is the head's --port (6379 by default) and that this machine can reach that host; "
                "or drop run.ray_address to start a local cluster",
            )
        ]
    )


def join_settings(
    address: str, *, probe_s: float = JOIN_PROBE_S, ray_imported: bool = False
) -> dict[str, str]:
    """Probe `address` (see the module doc); the environment settings Ray needs to reach it."""
    parsed = split_address(address)
    if parsed is None:
        return {}
    host, port = parsed
    deadline = time.monotonic() + probe_s
    while not reachable(host, port):
        if time.monotonic() >= deadline:
            raise _unreachable(address, probe_s)
        time.sleep(1.0)
    if host not in LOOPBACK_HOSTS:
        return {}
    dialled = interface_ip()
    if dialled is None or dialled.startswith("127.") or reachable(dialled, port):
        return {}  # Ray's rewrite of the loopback address reaches the head too
    if ray_imported:
        from ray._private import ray_constants  # Ray reads this when it resolves the address

        if not ray_constants.ENABLE_RAY_CLUSTER:
            return {}  # the loopback setting is in effect: Ray keeps 127.0.0.1
        pin = " ".join(f"{k}={v}" for k, v in LOOPBACK_ENV.items())
        raise ConfigError(
            [
                Problem(
                    "run.ray_address",
                    f"the Ray head at {address} listens on loopback only, and Ray (imported before verst "
                    f"could keep it on loopback) would dial {dialled}:{port} instead",
                    f"set {pin} in the environment before Ray is imported, or give the head's "
                    f"interface address, or start the head without --node-ip-address={LOOPBACK}",
                )
            ]
        )
    return dict(LOOPBACK_ENV)
