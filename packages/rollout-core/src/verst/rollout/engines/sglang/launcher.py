"""Start inference servers as subprocesses, wait until they serve, stop them with the run.

    with launch_verst_servers(model_path, num_servers=2) as servers:
        client = SGLangClient(servers.urls[0])
    with launch_sglang_servers(model_path, num_servers=2, router=True) as servers:
        client = SGLangClient(servers.router_url, router=True)

`launch_sglang_servers` runs `python -m sglang.launch_server` (and `sglang_router.launch_router`),
which needs the `sglang` extra; `launch_verst_servers` runs `verst serve` (what the tests and
CPU benchmarks use). Readiness is `GET /health_generate` answering 200 before a deadline; a
process that exits early fails at once with the tail of its log. Shutdown: SIGTERM, then
SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from verst.rollout.engine import EngineError
from verst.rollout.engines.common.errors import require
from verst.rollout.engines.common.wire import worker_urls as parse_worker_urls

ROUTER_WORKERS_WAIT_S = 300.0
"""How long a launched router may take to list every worker after `/readiness` turned 200."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free right now."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class ServerProcess:
    """One launched server."""

    url: str
    """Base URL, e.g. http://127.0.0.1:30000."""
    process: subprocess.Popen[bytes]
    """The child process."""
    log_path: Path
    """Its combined stdout/stderr."""
    scratch: Path | None = None
    """A temp directory only this server writes (vLLM: its IPC sockets), removed by `stop`."""

    def log_tail(self, n: int = 40) -> str:
        """The last lines of the log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited after `grace_s`."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


@dataclass
class LaunchedServers:
    """Servers (and an optional router) that live as long as this object's context."""

    servers: list[ServerProcess] = field(default_factory=list)
    """The engine servers."""
    router: ServerProcess | None = None
    """The router in front of them, if launched."""

    @property
    def urls(self) -> list[str]:
        """Base URLs of the engine servers."""
        return [s.url for s in self.servers]

    @property
    def router_url(self) -> str | None:
        """Base URL of the router, if any."""
        return self.router.url if self.router else None

    def close(self) -> None:
        """Stop everything (router first)."""
        for proc in ([self.router] if self.router else []) + list(self.servers):
            proc.stop()

    def __enter__(self) -> LaunchedServers:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _spawn(cmd: list[str], url: str, log_dir: Path, name: str, env: dict[str, str] | None) -> ServerProcess:
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return ServerProcess(url, proc, log_path)


def wait_ready(server: ServerProcess, deadline_s: float, path: str = "/health_generate") -> None:
    """Poll `path` until 200; raise EngineError (with the log tail) on exit or deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if server.process.poll() is not None:
            raise EngineError(
                f"server {server.url} exited with code {server.process.returncode} before it was ready; "
                f"log {server.log_path}:\n{server.log_tail()}"
            )
        try:
            with urllib.request.urlopen(server.url + path, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise EngineError(
        f"server {server.url} not ready after {deadline_s:.0f}s (GET {path}); log {server.log_path}:\n{server.log_tail()}"
    )


def wait_router_workers(router: ServerProcess, expected: Sequence[str], deadline_s: float) -> list[str]:
    """Poll the router's `GET /workers` until every `expected` worker is listed; return the
    listing. sglang-router 0.3.x answers `/readiness` 200 once one worker is healthy, so a
    client that trusted it alone would send everything to the first worker."""
    want = [u.rstrip("/") for u in expected]
    listed: list[str] = []
    end = time.monotonic() + deadline_s
    while True:
        if router.process.poll() is not None:
            raise EngineError(
                f"router {router.url} exited with code {router.process.returncode} before it listed "
                f"its workers; log {router.log_path}:\n{router.log_tail()}"
            )
        try:
            with urllib.request.urlopen(router.url + "/workers", timeout=5) as resp:
                listed = parse_worker_urls(json.loads(resp.read())) or []
        except (urllib.error.URLError, OSError, ValueError):
            pass
        missing = [u for u in want if u not in listed]
        if not missing:
            return listed
        if time.monotonic() >= end:
            raise EngineError(
                f"router {router.url} did not list workers {missing} within {deadline_s:.0f}s "
                f"(GET /workers lists {listed}); log {router.log_path}:\n{router.log_tail()}"
            )
        time.sleep(0.2)


def _launch(
    commands: list[tuple[list[str], str]],
    *,
    name: str,
    ready_timeout_s: float,
    env: dict[str, str] | None,
    log_dir: str | Path | None,
) -> LaunchedServers:
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=f"verst-{name}-"))
    logs.mkdir(parents=True, exist_ok=True)
    launched = LaunchedServers()
    try:
        for i, (cmd, url) in enumerate(commands):
            launched.servers.append(_spawn(cmd, url, logs, f"{name}-{i}", env))
        for server in launched.servers:
            wait_ready(server, ready_timeout_s)
    except BaseException:
        launched.close()
        raise
    return launched


def _ports(n: int, host: str, port_base: int | None) -> list[int]:
    return [port_base + i for i in range(n)] if port_base else [free_port(host) for _ in range(n)]


def launch_verst_servers(
    model_path: str | Path,
    *,
    num_servers: int = 1,
    host: str = "127.0.0.1",
    port_base: int | None = None,
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    log_dir: str | Path | None = None,
) -> LaunchedServers:
    """Start `num_servers` `verst serve` processes (free ports unless `port_base`), at weight
    version 0 like `launch_sglang_servers`."""
    commands = []
    for port in _ports(num_servers, host, port_base):
        cmd = [sys.executable, "-m", "verst.rollout.engines.serve.server", "--model", str(model_path)]
        cmd += ["--host", host, "--port", str(port), "--weight-version", "0", *extra_args]
        commands.append((cmd, f"http://{host}:{port}"))
    return _launch(commands, name="verst-serve", ready_timeout_s=ready_timeout_s, env=env, log_dir=log_dir)


def sglang_server_command(
    model_path: str | Path,
    index: int,
    *,
    host: str,
    port: int,
    tp_size: int = 1,
    base_gpu_id: int = 0,
    mem_fraction_static: float | None = None,
    memory_saver: bool = False,
    deterministic: bool = False,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The `python -m sglang.launch_server` command of server `index` (0-based).

    Each server gets its own GPUs (`--base-gpu-id base + index * tp_size`) and starts at weight
    version 0 (`--weight-version 0`; SGLang's default is the string "default"). `memory_saver`
    (colocated training) adds `--enable-memory-saver` (without it `release_memory_occupation`
    is a no-op) and `--enable-weights-cpu-backup` (without it released weights do not come back
    on resume); `deterministic` adds `--enable-deterministic-inference` (without it
    `sampling_seed` is ignored).
    """
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path)]
    cmd += ["--host", host, "--port", str(port), "--tp-size", str(tp_size)]
    cmd += ["--base-gpu-id", str(base_gpu_id + index * tp_size), "--weight-version", "0"]
    if mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(mem_fraction_static)]
    if memory_saver:
        cmd += ["--enable-memory-saver", "--enable-weights-cpu-backup"]
    if deterministic:
        cmd += ["--enable-deterministic-inference"]
    return [*cmd, *extra_args]


def launch_sglang_servers(
    model_path: str | Path,
    *,
    num_servers: int = 1,
    host: str = "127.0.0.1",
    port_base: int | None = None,
    router: bool = False,
    router_policy: str = "cache_aware",
    router_extra_args: Sequence[str] = (),
    ready_timeout_s: float = 900.0,
    env: dict[str, str] | None = None,
    log_dir: str | Path | None = None,
    **server: Any,
) -> LaunchedServers:
    """Start real SGLang servers (and a router); needs `uv sync --extra sglang` and a GPU.

    `server`: `sglang_server_command`'s keywords, the flags each server gets (`tp_size`,
    `base_gpu_id`, `mem_fraction_static`, `memory_saver`, `deterministic`, `extra_args`). The router (sglang-router 0.3.x)
    is ready when `GET /readiness` answers 200 and `GET /workers` lists every server."""
    require("sglang", extra="sglang", feature="launching SGLang servers")
    if router:
        require("sglang_router", extra="sglang", feature="launching the SGLang router")
    commands = []
    for i, port in enumerate(_ports(num_servers, host, port_base)):
        cmd = sglang_server_command(model_path, i, host=host, port=port, **server)
        commands.append((cmd, f"http://{host}:{port}"))
    launched = _launch(commands, name="sglang", ready_timeout_s=ready_timeout_s, env=env, log_dir=log_dir)
    if not router:
        return launched
    try:
        logs = launched.servers[0].log_path.parent
        launched.router = launch_router(
            launched.urls,
            host=host,
            policy=router_policy,
            extra_args=router_extra_args,
            ready_timeout_s=ready_timeout_s,
            env=env,
            log_dir=logs,
        )
    except BaseException:
        launched.close()
        raise
    return launched


def launch_router(
    worker_urls: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    policy: str = "cache_aware",
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    log_dir: str | Path | None = None,
) -> ServerProcess:
    """Start `python -m sglang_router.launch_router` in front of `worker_urls`; ready when
    `GET /readiness` is 200 (sglang-router 0.3.x) and `GET /workers` lists every worker
    (`wait_router_workers`). Stop it with `.stop()`."""
    require("sglang_router", extra="sglang", feature="launching the SGLang router")
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="verst-router-"))
    logs.mkdir(parents=True, exist_ok=True)
    port = port or free_port(host)
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port)]
    cmd += ["--worker-urls", *worker_urls, "--policy", policy, *extra_args]
    proc = _spawn(cmd, f"http://{host}:{port}", logs, "router", env)
    try:
        wait_ready(proc, ready_timeout_s, path="/readiness")
        wait_router_workers(proc, worker_urls, ROUTER_WORKERS_WAIT_S)
    except BaseException:
        proc.stop()
        raise
    return proc
