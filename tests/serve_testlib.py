"""`verst serve`'s app (or any aiohttp app: `serve_app`) on the calling test's event loop, optionally
recording what it receives."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

from aiohttp import web

from verst.rollout.engines.sglang.launcher import free_port

CONTROL = ("/generate", "/model_info", "/server_info", "/v1/loads")
"""Paths not recorded (only the control calls are)."""


@asynccontextmanager
async def serve(model_dir, *, info=None, record=None):
    """`verst serve`'s app on this loop; `record` collects (path, body) of control calls."""
    from verst.rollout.engines.embedded.engine import EmbeddedEngine
    from verst.rollout.engines.serve.server import build_app

    app = build_app(EmbeddedEngine.from_pretrained(model_dir), info=info)
    if record is not None:

        @web.middleware
        async def recorder(request, handler):
            if request.path not in CONTROL:
                raw = await request.read()
                record.append((request.path, json.loads(raw) if raw else None))
            return await handler(request)

        app.middlewares.insert(0, recorder)
    async with serve_app(app) as url:
        yield url


@asynccontextmanager
async def serve_app(app: web.Application):
    """Any aiohttp app on 127.0.0.1 (a free port) on this loop; yields its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
