"""A run against an engine that stalls stops within the bound with the one-line `EngineTimeout`
(issue 39, item 7): a generate that never answers during a rollout, and a refit that stalls
(the start's weight push): `verst train` prints it and exits with `EXIT_ROLLOUT_FAILED` (it is a
`RolloutError`).

Real parts: the trainer and `run_training`; a stand-in SGLang server (a thread on loopback)
simulates the stall, the other routes answer like `verst serve` would.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from aiohttp import web
from serve_testlib import serve_app
from train_testlib_e2e import run_config

from verst.rollout.engine import EngineTimeout
from verst.rollout.errors import RolloutError
from verst.trainer.cli import EXIT_ROLLOUT_FAILED, main
from verst.trainer.run.controller import InMemoryLogger, run_training

pytestmark = pytest.mark.timeout(120)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reverse_digits"
BOUND = 1.0


class StallingServer:
    """An SGLang-like server in a thread: `stall` never answers; it keeps the version it is sent."""

    def __init__(self, stall: str) -> None:
        self.stall, self.version, self.url = stall, "0", ""
        self._loop = asyncio.new_event_loop()
        self._ready, self._release = threading.Event(), asyncio.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(),))

    async def _handler(self, request: web.Request) -> web.StreamResponse:
        if request.path == self.stall:
            await self._release.wait()
            return web.json_response({})
        if request.path == "/model_info":
            return web.json_response({"weight_version": self.version})
        if request.path == "/update_weights_from_disk":
            self.version = (await request.json())["weight_version"]
        return web.json_response({"success": True} if request.path != "/server_info" else {})

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handler)
        self._stop = asyncio.Event()
        async with serve_app(app) as url:
            self.url = url
            self._ready.set()
            await self._stop.wait()
            self._release.set()

    def __enter__(self) -> StallingServer:
        self._thread.start()
        self._ready.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        self._loop.close()


class PhaseClock(InMemoryLogger):
    """When each phase began."""

    def __init__(self) -> None:
        super().__init__()
        self.started: dict[str, float] = {}

    def phase(self, name: str) -> None:
        super().phase(name)
        self.started.setdefault(name, time.monotonic())


def _engine(url):
    return {"type": "sglang", "urls": [url], "request_timeout_s": BOUND}


def test_a_generate_that_never_answers_stops_the_run_within_its_bound(tmp_path, tiny_checkpoint, monkeypatch):
    with StallingServer("/generate") as server:
        cfg = run_config(tmp_path, tiny_checkpoint, monkeypatch, engine=_engine(server.url))
        clock = PhaseClock()
        with pytest.raises(EngineTimeout) as info:
            run_training(cfg, tmp_path / "run", env={}, logger=clock)
    assert isinstance(info.value, RolloutError)  # `verst train` prints it, exit code 3
    # the rollout ends within the bound; then the run checkpoints (every prompt in play kept)
    assert clock.started["checkpoint"] - clock.started["rollout"] < BOUND + 1.5
    message = str(info.value)
    assert f"engine {server.url}: POST /generate" in message and "engine.request_timeout_s = 1" in message


def test_verst_train_against_a_refit_that_stalls_prints_the_line_and_exits(tmp_path, capsys):
    with StallingServer("/update_weights_from_disk") as server:
        start = time.monotonic()
        code = main(
            [
                "train",
                str(EXAMPLE / "config.toml"),
                f'run.output_dir="{tmp_path / "run"}"',
                "run.num_steps=1",
                f'engine={{type="sglang", urls=["{server.url}"], refit_timeout_s={BOUND}}}',
                "rollout.eval.datasets={}",
            ]
        )
    took = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == EXIT_ROLLOUT_FAILED, err
    line = f"engine {server.url}: POST /update_weights_from_disk got no complete answer within 1s"
    assert line in err and "(engine.refit_timeout_s = 1)" in err, err
    assert took < 30  # the model load and the start's weight write, then one bound
