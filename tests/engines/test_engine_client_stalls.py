"""No engine call can hang (issue 39, item 7): an engine that accepts the connection and never
answers, answers half a body, or stalls mid-refit makes the call fail with `EngineTimeout` — one
line naming the engine, the route and the bound from the config — within that bound, retries
included; a run against such an engine stops with it.

A stand-in server simulates the faults (only the faulty route stalls; the others answer like
SGLang / vLLM would); the happy paths run against real servers elsewhere.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from serve_testlib import serve_app

from verst.rollout.engine import EngineTimeout, GenerateRequest, SamplingParams
from verst.rollout.engines.sglang.client import SGLangClient
from verst.rollout.engines.vllm.client import VllmClient

BOUND = 0.25
"""Every bound of these tests (seconds)."""
SLACK = 0.75
"""How much later than its bound a call may fail (the box is shared)."""
BOUNDS = {
    "timeout_s": BOUND,
    "control_timeout_s": BOUND,
    "refit_timeout_s": BOUND,
    "health_timeout_s": BOUND,
    "max_retries": 3,
    "backoff_s": 0.01,
}
KEYS = {
    "generate": "engine.request_timeout_s",
    "control": "engine.control_timeout_s",
    "refit": "engine.refit_timeout_s",
    "health": "engine.health_timeout_s",
}
SGLANG_OUT = {
    "text": "ab",
    "output_ids": [7, 8],
    "meta_info": {
        "id": "r",
        "finish_reason": {"type": "length", "length": 2},
        "prompt_tokens": 2,
        "weight_version": "0",
        "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]],
    },
}


@asynccontextmanager
async def stalling_server(stall: str, how: str, answers: dict):
    """Every path answers `answers.get(path, {"success": True})`, except `stall`, which never
    answers (`how="silent"`) or sends its headers and half a body, then nothing (`"half"`)."""
    release = asyncio.Event()
    calls: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        calls.append(request.path)
        if request.path != stall:
            return web.json_response(answers.get(request.path, {"success": True}))
        if how == "half":
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.content_length = 200
            await resp.prepare(request)
            await resp.write(b'{"text": "ab", "output_ids": [7,')
            await release.wait()
            return resp
        await release.wait()
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    async with serve_app(app) as url:
        try:
            yield url, calls
        finally:
            release.set()


def _sglang(url):
    return SGLangClient(url, **BOUNDS)


def _vllm(url):
    return VllmClient(url, **BOUNDS)


def _request():
    return GenerateRequest([1, 2], SamplingParams(2))


# (name, client, the call, the stalled route, its kind, what the other routes answer)
SGLANG_ANSWERS = {"/model_info": {"weight_version": "0"}, "/server_info": {}, "/generate": SGLANG_OUT}
VLLM_ANSWERS = {"/weight_info": {"weight_version": "0"}}
CASES = [
    ("sglang generate", _sglang, lambda c: c.generate(_request()), "/generate", "generate", SGLANG_ANSWERS),
    ("sglang abort", _sglang, lambda c: c.abort(None), "/abort_request", "control", SGLANG_ANSWERS),
    ("sglang version", _sglang, lambda c: c.get_weight_version(), "/model_info", "control", {}),
    (
        "sglang pause (refit)",
        _sglang,
        lambda c: c.update_weights_from_disk("/ckpt", 1),
        "/pause_generation",
        "control",
        SGLANG_ANSWERS,
    ),
    (
        "sglang disk refit",
        _sglang,
        lambda c: c.update_weights_from_disk("/ckpt", 1),
        "/update_weights_from_disk",
        "refit",
        SGLANG_ANSWERS,
    ),
    (
        "sglang mid-refit bucket",
        _sglang,
        lambda c: c.update_weights_from_tensors({"w": __import__("torch").ones(2)}, 1),
        "/update_weights_from_tensor",
        "refit",
        SGLANG_ANSWERS,
    ),
    (
        "sglang end of refit",
        _sglang,
        lambda c: c.update_weights_from_tensors({"w": __import__("torch").ones(2)}, 1),
        "/end_weight_update",
        "refit",
        SGLANG_ANSWERS,
    ),
    ("sglang health", _sglang, lambda c: c.health(), "/health", "health", {}),
    ("vllm generate", _vllm, lambda c: c.generate(_request()), "/inference/v1/generate", "generate", {}),
    ("vllm abort", _vllm, lambda c: c.abort(None), "/abort_requests", "control", {}),
    ("vllm pause", _vllm, lambda c: c.pause("keep"), "/pause", "control", {}),
    ("vllm resume", _vllm, lambda c: c.resume(), "/resume", "control", {}),
    (
        "vllm reload mid-refit",
        _vllm,
        lambda c: c.update_weights_from_disk("/ckpt", 1),
        "/collective_rpc",
        "refit",
        VLLM_ANSWERS,
    ),
    (
        "vllm version set",
        _vllm,
        lambda c: c.update_weights_from_disk("/ckpt", 1),
        "/update_weight_version",
        "refit",
        VLLM_ANSWERS,
    ),
    ("vllm health", _vllm, lambda c: c.health(), "/health", "health", {}),
]


HALF_BODY = {
    "sglang generate",
    "sglang version",
    "sglang disk refit",
    "vllm generate",
    "vllm reload mid-refit",
}
"""The cases also run with half a body (a body-carrying answer of each kind and client)."""
STALLS = [(*c, "silent") for c in CASES] + [(*c, "half") for c in CASES if c[0] in HALF_BODY]


@pytest.mark.parametrize(
    ("name", "make", "act", "route", "kind", "answers", "how"),
    STALLS,
    ids=[f"{c[0]}-{c[-1]}" for c in STALLS],
)
async def test_a_stalled_route_fails_within_its_bound_naming_engine_route_and_bound(
    name, make, act, route, kind, answers, how
):
    async with stalling_server(route, how, answers) as (url, calls):
        client = make(url)
        start = time.monotonic()
        with pytest.raises(EngineTimeout) as info:
            await act(client)
        took = time.monotonic() - start
        await client.close()
    message = str(info.value)
    assert took < BOUND + SLACK, f"{name}: failed after {took:.2f}s, its bound is {BOUND}s"
    assert "\n" not in message
    assert url in message and route in message and f"{KEYS[kind]} = {BOUND:g}" in message, message
    assert route in calls
    assert info.value.retryable is False


async def test_a_stall_later_than_the_first_try_still_ends_within_one_bound():
    """The bound is for the whole call: a 503 then a stall do not get a fresh bound per try."""
    release = asyncio.Event()
    seen: list[float] = []

    async def generate(request: web.Request) -> web.StreamResponse:
        seen.append(time.monotonic())
        if len(seen) == 1:
            await asyncio.sleep(BOUND * 0.5)
            return web.json_response({"error": "starting"}, status=503)
        await release.wait()
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/generate", generate)
    async with serve_app(app) as url:
        client = _sglang(url)
        start = time.monotonic()
        try:
            with pytest.raises(EngineTimeout, match=r"POST /generate .*engine.request_timeout_s"):
                await client.generate(_request())
        finally:
            release.set()
            await client.close()
    assert len(seen) >= 2 and time.monotonic() - start < BOUND + SLACK  # retried, within the one bound


def test_a_distributed_refit_call_that_never_returns_fails_within_the_group_timeout():
    """The distributed weight sync waits for each engine call at most `group_timeout_s`, then
    names the engine and the bound (the call's own bound may be longer)."""
    import concurrent.futures

    from verst.trainer.sync.distributed import answer
    from verst.trainer.sync.protocols import WeightSyncError

    never = concurrent.futures.Future()
    start = time.monotonic()
    with pytest.raises(
        WeightSyncError, match=r"SGLangClient\('http://127.0.0.1:9'.*within 0.25s.*group_timeout_s"
    ):
        answer(never, BOUND, SGLangClient("http://127.0.0.1:9"))
    assert time.monotonic() - start < BOUND + SLACK and never.cancelled()
