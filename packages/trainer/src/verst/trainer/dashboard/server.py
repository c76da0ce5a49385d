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
import json
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from verst.rollout.errors import ConfigError, Problem
from verst.trainer.dashboard.assets import asset_bytes, asset_names, page_html
from verst.trainer.dashboard.auth import token_middleware
from verst.trainer.dashboard.compare import compare_runs
from verst.trainer.dashboard.run_data import RunData
from verst.trainer.dashboard.samples_view import SampleQuery

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8391
"""Not Ray's dashboard port (8265), TensorBoard's (6006) or Jupyter's (8888)."""
_TYPES = {".js": "application/javascript", ".css": "text/css", ".html": "text/html"}


def load_runs(paths: Sequence[str | Path]) -> list[RunData]:
    """One `RunData` per run directory (they may not hold any file yet)."""
    runs = []
    for i, p in enumerate(paths):
        root = Path(p).resolve()
        if not root.is_dir():
            raise FileNotFoundError(f"run directory {p} does not exist (pass the run.output_dir of a run)")
        runs.append(RunData(root, run_id=i))
    return runs


def run_entry(run: RunData) -> dict[str, Any]:
    """The `/api/runs` entry of a run: id, name (`run.name`), folder, path."""
    return {"id": run.run_id, "name": run.name, "folder": run.root.name, "path": str(run.root)}


def _json(data: Any) -> web.Response:
    return web.Response(
        text=json.dumps(data, default=str, allow_nan=False, separators=(",", ":")),
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )


def _int(request: web.Request, name: str, default: int | None = None) -> int:
    raw = request.query.get(name)
    if raw is None:
        if default is None:
            raise web.HTTPBadRequest(text=f"query parameter {name!r} is required")
        return default
    try:
        return int(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=f"query parameter {name!r} must be an integer, got {raw!r}") from None


def _float(request: web.Request, name: str) -> float | None:
    raw = request.query.get(name, "")
    if raw == "":
        return None
    try:
        return float(raw)
    except ValueError:
        raise web.HTTPBadRequest(text=f"query parameter {name!r} must be a number, got {raw!r}") from None


def _sample_query(request: web.Request) -> SampleQuery:
    statuses = [s for s in request.query.get("status", "").split(",") if s]
    try:
        return SampleQuery(
            text=request.query.get("q", ""),
            sort=request.query.get("sort", ""),
            desc=request.query.get("desc", "0") in ("1", "true"),
            statuses=tuple(statuses),
            reward_min=_float(request, "reward_min"),
            reward_max=_float(request, "reward_max"),
        )
    except ValueError as exc:
        raise web.HTTPBadRequest(text=str(exc)) from None


def build_app(runs: Sequence[RunData], *, token: str | None = None) -> web.Application:
    """The aiohttp application serving `runs` (every request needs `token` when one is given)."""
    app = web.Application(middlewares=[token_middleware(token)] if token else [])

    def run_of(request: web.Request) -> RunData:
        try:
            run = runs[int(request.match_info["id"])]
        except (ValueError, IndexError):
            raise web.HTTPNotFound(text=f"no run {request.match_info['id']!r}") from None
        return run

    async def view(request: web.Request, fn: Callable[[RunData], Any]) -> web.Response:
        run = run_of(request)

        def work() -> Any:
            run.refresh()
            return fn(run)

        return _json(await asyncio.to_thread(work))

    async def index(request: web.Request) -> web.Response:
        return web.Response(text=page_html(), content_type="text/html")

    async def static(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in asset_names():
            raise web.HTTPNotFound(text=f"no asset {name!r}")
        return web.Response(
            body=asset_bytes(name),
            content_type=_TYPES.get(Path(name).suffix, "application/octet-stream"),
            headers={"Cache-Control": "max-age=3600"},
        )

    async def list_runs(request: web.Request) -> web.Response:
        return _json([run_entry(r) for r in runs])

    async def overview(request: web.Request) -> web.Response:
        return await view(request, lambda r: r.overview())

    async def curves(request: web.Request) -> web.Response:
        names = request.query.get("names")
        wanted = [n for n in names.split(",") if n] if names is not None else None
        return await view(request, lambda r: r.curves(wanted))

    async def steps(request: web.Request) -> web.Response:
        return await view(request, lambda r: r.steps())

    async def timeline(request: web.Request) -> web.Response:
        step = _int(request, "step")
        offset, limit = _int(request, "offset", 0), _int(request, "limit", 2000)
        return await view(request, lambda r: r.timeline(step, offset=offset, limit=limit))

    async def samples(request: web.Request) -> web.Response:
        step = _int(request, "step")
        offset, limit = _int(request, "offset", 0), _int(request, "limit", 50)
        split, query = request.query.get("split", "train"), _sample_query(request)
        return await view(
            request, lambda r: r.samples(step, split=split, query=query, offset=offset, limit=limit)
        )

    async def trajectory(request: web.Request) -> web.Response:
        step, sample = _int(request, "step"), _int(request, "sample")
        split = request.query.get("split", "train")
        found = await view(request, lambda r: r.trajectory(step, split, sample))
        return found

    async def compare(request: web.Request) -> web.Response:
        def work() -> Any:
            for run in runs:
                run.refresh()
            return compare_runs(runs)

        return _json(await asyncio.to_thread(work))

    async def run_file(request: web.Request) -> web.StreamResponse:
        run = run_of(request)
        rel = request.match_info["path"]
        if "\x00" in rel:
            raise web.HTTPBadRequest(text="a file path cannot hold a NUL byte")
        target = (run.root / rel).resolve()
        if not target.is_relative_to(run.root) or Path(rel).is_absolute():
            raise web.HTTPForbidden(text="outside the run directory")
        if not target.is_file():
            raise web.HTTPNotFound(text=f"no file {rel!r} in run {run.name!r}")
        return web.FileResponse(target)

    async def favicon(request: web.Request) -> web.Response:
        return web.Response(status=204)

    app.router.add_get("/", index)
    app.router.add_get("/favicon.ico", favicon)
    app.router.add_get("/static/{name}", static)
    app.router.add_get("/api/runs", list_runs)
    app.router.add_get("/api/runs/{id}/overview", overview)
    app.router.add_get("/api/runs/{id}/curves", curves)
    app.router.add_get("/api/runs/{id}/steps", steps)
    app.router.add_get("/api/runs/{id}/timeline", timeline)
    app.router.add_get("/api/runs/{id}/samples", samples)
    app.router.add_get("/api/runs/{id}/trajectory", trajectory)
    app.router.add_get("/api/compare", compare)
    app.router.add_get("/runs/{id}/files/{path:.+}", run_file)
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
