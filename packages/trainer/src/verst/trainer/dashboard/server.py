"""The dashboard's HTTP server (aiohttp): the page, its assets, and JSON views of the runs.

Read-only (GET only) and bound to 127.0.0.1 unless told otherwise. Runs are addressed by their
index in the command line, never by a path from the client; `/runs/<id>/files/<path>` serves a
file inside that run directory and answers 403 to anything that resolves outside it (`..`,
symlinks out, absolute paths). Every view refreshes its run first (reading only what the files
gained), so a page that polls sees a live run move.

Routes::

    GET /                                   the page
    GET /static/<name>                      page assets (app.js, style.css, plotly.min.js)
    GET /api/runs                           [{id, name, path}]
    GET /api/runs/<id>/overview             status, config summary, eval rewards, file health
    GET /api/runs/<id>/curves?names=a,b     metric names and the chosen series (all when absent)
    GET /api/runs/<id>/steps                per-step timeline summary, steps with samples
    GET /api/runs/<id>/timeline?step=N&offset=&limit=
    GET /api/runs/<id>/samples?step=N&split=train&q=&offset=&limit=&sort=&desc=&status=&reward_min=&reward_max=
    GET /api/runs/<id>/trajectory?step=N&split=train&sample=I   one recorded full trajectory
    GET /api/compare                        every run's config (differences marked), final / best metrics
    GET /runs/<id>/files/<path>             a file of the run directory (e.g. curves.png)

Bound to a non-loopback `--host`, every request needs the access token (`auth`).
"""

from __future__ import annotations

import asyncio
import errno
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from aiohttp import web

from verst.rollout.errors import ConfigError, Problem
from verst.trainer.dashboard.auth import token_middleware
from verst.trainer.dashboard.routes import Views
from verst.trainer.dashboard.run_data import RunData

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8391
"""Not Ray's dashboard port (8265), TensorBoard's (6006) or Jupyter's (8888)."""


def load_runs(paths: Sequence[str | Path]) -> list[RunData]:
    """One `RunData` per run directory (they may not hold any file yet)."""
    runs = []
    for i, p in enumerate(paths):
        root = Path(p).resolve()
        if not root.is_dir():
            raise FileNotFoundError(f"run directory {p} does not exist (pass the run.output_dir of a run)")
        runs.append(RunData(root, run_id=i))
    return runs


def build_app(runs: Sequence[RunData], *, token: str | None = None) -> web.Application:
    """The aiohttp application serving `runs` (every request needs `token` when one is given)."""
    app = web.Application(middlewares=[token_middleware(token)] if token else [])
    app.add_routes(Views(runs).routes())
    return app


async def start_server(
    runs: Sequence[RunData], *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, token: str | None = None
) -> tuple[web.AppRunner, int]:
    """Start serving (port 0 picks a free one); returns the runner (`await runner.cleanup()`) and port.

    A port that is taken (or not ours to bind) is a `ConfigError` naming `--port`."""
    runner = web.AppRunner(build_app(runs, token=token), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise _bind_error(exc, host, port) from None
    loop = asyncio.get_running_loop()
    for run in runs:  # index the files now, while the browser is still loading the page
        loop.run_in_executor(None, lambda r=run: (r.refresh(force=True), r.trajectories.read()))
    sockets = site._server.sockets if site._server is not None else []  # type: ignore[union-attr]
    bound = sockets[0].getsockname()[1] if sockets else port
    return runner, bound


def _bind_error(exc: OSError, host: str, port: int) -> ConfigError:
    if exc.errno == errno.EADDRINUSE:
        why = f"port {port} on {host} is already in use (another program, or another verst dashboard, listens there)"
    elif exc.errno == errno.EACCES:
        why = f"not allowed to bind port {port} on {host} (ports below 1024 need privileges)"
    else:
        why = f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return ConfigError(
        [Problem("--port", why, "pass another port, e.g. --port 8392, or --port 0 to pick a free one")]
    )


def serve(
    paths: Sequence[str | Path],
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    token: str | None = None,
    on_ready: Callable[[str], None] = print,
) -> None:
    """Serve the dashboard of `paths` until interrupted (every request needs `token` if given)."""
    runs = load_runs(paths)

    async def main() -> None:
        runner, bound = await start_server(runs, host=host, port=port, token=token)
        query = f"?token={token}" if token else ""
        on_ready(f"verst dashboard: http://{host}:{bound}/{query}  ({len(runs)} run(s); Ctrl-C stops)")
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    asyncio.run(main())


class BackgroundServer:
    """A dashboard server on its own event loop in a daemon thread (tests, benchmarks, notebooks).

    `with BackgroundServer([run_dir]) as srv: srv.url` — stopped on exit."""

    def __init__(
        self,
        paths: Sequence[str | Path],
        *,
        host: str = DEFAULT_HOST,
        port: int = 0,
        token: str | None = None,
    ) -> None:
        self.runs = load_runs(paths)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="verst-dashboard", daemon=True)
        self._thread.start()
        try:
            self.runner, self.port = asyncio.run_coroutine_threadsafe(
                start_server(self.runs, host=host, port=port, token=token), self._loop
            ).result(timeout=30)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
            raise
        self.url = f"http://{host}:{self.port}/"
        """The page's address (without the token)."""

    def close(self) -> None:
        """Stop serving and end the thread."""
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
