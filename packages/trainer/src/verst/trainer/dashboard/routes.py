"""The dashboard's request handlers: the page, its assets, the JSON views and a run's files.

`Views(runs).routes()` is what `server.build_app` registers. Each JSON view refreshes its run,
builds its answer and encodes it in a worker thread (the event loop only moves bytes), and says
what that cost in a `Server-Timing` header (`view;dur=<ms>` wall, `cpu;dur=<ms>` the worker
thread's CPU time) — the browser's resource timing and devtools show it per request.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from verst.trainer.dashboard.assets import asset_bytes, asset_names, page_html
from verst.trainer.dashboard.compare import compare_runs
from verst.trainer.dashboard.run_data import RunData
from verst.trainer.dashboard.samples_view import SampleQuery

_TYPES = {".js": "application/javascript", ".css": "text/css", ".html": "text/html"}


def encode(data: Any) -> bytes:
    """A view as compact JSON (NaN refused: the page's JSON.parse would choke on it)."""
    return json.dumps(data, default=str, allow_nan=False, separators=(",", ":")).encode("utf-8")


def _timed(work: Callable[[], Any]) -> Callable[[], tuple[bytes, str]]:
    def run() -> tuple[bytes, str]:
        wall, cpu = time.perf_counter(), time.thread_time()
        body = encode(work())
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        return body, f"view;dur={wall * 1e3:.1f}, cpu;dur={cpu * 1e3:.1f}"

    return run


async def json_response(work: Callable[[], Any]) -> web.Response:
    """`work()`'s result as JSON, computed and encoded in a worker thread, with its timing."""
    body, timing = await asyncio.to_thread(_timed(work))
    return web.Response(
        body=body,
        content_type="application/json",
        charset="utf-8",
        headers={"Cache-Control": "no-store", "Server-Timing": timing},
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


def sample_query(request: web.Request) -> SampleQuery:
    """The samples view's filter and order from the query string (400 when malformed)."""
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


def run_entry(run: RunData) -> dict[str, Any]:
    """The `/api/runs` entry of a run: id, name (`run.name`), folder, path."""
    return {"id": run.run_id, "name": run.name, "folder": run.root.name, "path": str(run.root)}


class Views:
    """The handlers of one dashboard over `runs` (addressed by index, never by path)."""

    def __init__(self, runs: Sequence[RunData]) -> None:
        self.runs = runs

    def routes(self) -> list[web.RouteDef]:
        """Every route the dashboard serves (see `server`'s docstring)."""
        return [
            web.get("/", self.index),
            web.get("/favicon.ico", self.favicon),
            web.get("/static/{name}", self.static),
            web.get("/api/runs", self.list_runs),
            web.get("/api/runs/{id}/overview", self.overview),
            web.get("/api/runs/{id}/curves", self.curves),
            web.get("/api/runs/{id}/steps", self.steps),
            web.get("/api/runs/{id}/timeline", self.timeline),
            web.get("/api/runs/{id}/samples", self.samples),
            web.get("/api/runs/{id}/trajectory", self.trajectory),
            web.get("/api/compare", self.compare),
            web.get("/runs/{id}/files/{path:.+}", self.run_file),
        ]

    def run_of(self, request: web.Request) -> RunData:
        """The run the request's `{id}` names (404 when none)."""
        try:
            return self.runs[int(request.match_info["id"])]
        except (ValueError, IndexError):
            raise web.HTTPNotFound(text=f"no run {request.match_info['id']!r}") from None

    async def view(self, request: web.Request, fn: Callable[[RunData], Any]) -> web.Response:
        """`fn(run)` of the request's run, after reading what its files gained."""
        run = self.run_of(request)

        def work() -> Any:
            run.refresh()
            return fn(run)

        return await json_response(work)

    # ------------------------------------------------------------ page and files

    async def index(self, request: web.Request) -> web.Response:
        return web.Response(text=page_html(), content_type="text/html")

    async def favicon(self, request: web.Request) -> web.Response:
        return web.Response(status=204)

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in asset_names():
            raise web.HTTPNotFound(text=f"no asset {name!r}")
        return web.Response(
            body=asset_bytes(name),
            content_type=_TYPES.get(Path(name).suffix, "application/octet-stream"),
            headers={"Cache-Control": "max-age=3600"},
        )

    async def run_file(self, request: web.Request) -> web.StreamResponse:
        run = self.run_of(request)
        rel = request.match_info["path"]
        if "\x00" in rel:
            raise web.HTTPBadRequest(text="a file path cannot hold a NUL byte")
        target = (run.root / rel).resolve()
        if not target.is_relative_to(run.root) or Path(rel).is_absolute():
            raise web.HTTPForbidden(text="outside the run directory")
        if not target.is_file():
            raise web.HTTPNotFound(text=f"no file {rel!r} in run {run.name!r}")
        return web.FileResponse(target)

    # ------------------------------------------------------------ JSON views

    async def list_runs(self, request: web.Request) -> web.Response:
        return await json_response(lambda: [run_entry(r) for r in self.runs])

    async def overview(self, request: web.Request) -> web.Response:
        return await self.view(request, lambda r: r.overview())

    async def curves(self, request: web.Request) -> web.Response:
        names = request.query.get("names")
        wanted = [n for n in names.split(",") if n] if names is not None else None
        return await self.view(request, lambda r: r.curves(wanted))

    async def steps(self, request: web.Request) -> web.Response:
        return await self.view(request, lambda r: r.steps())

    async def timeline(self, request: web.Request) -> web.Response:
        step = _int(request, "step")
        offset, limit = _int(request, "offset", 0), _int(request, "limit", 2000)
        return await self.view(request, lambda r: r.timeline(step, offset=offset, limit=limit))

    async def samples(self, request: web.Request) -> web.Response:
        step = _int(request, "step")
        offset, limit = _int(request, "offset", 0), _int(request, "limit", 50)
        split, query = request.query.get("split", "train"), sample_query(request)
        return await self.view(
            request, lambda r: r.samples(step, split=split, query=query, offset=offset, limit=limit)
        )

    async def trajectory(self, request: web.Request) -> web.Response:
        step, sample = _int(request, "step"), _int(request, "sample")
        split = request.query.get("split", "train")
        return await self.view(request, lambda r: r.trajectory(step, split, sample))

    async def compare(self, request: web.Request) -> web.Response:
        def work() -> Any:
            for run in self.runs:
                run.refresh()
            return compare_runs(self.runs)

        return await json_response(work)
