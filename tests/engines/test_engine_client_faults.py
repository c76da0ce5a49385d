"""SGLang client fault handling against a stand-in server that simulates the faults.

(Happy paths run against the real `verst serve` in test_engine_sglang_client.py.)
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from serve_testlib import serve_app

from verst.rollout.engine import EngineError, GenerateRequest, SamplingParams
from verst.rollout.engines.common.errors import InvalidRequest
from verst.rollout.engines.sglang.client import SGLangClient

OK_GENERATE = {
    "text": "ab",
    "output_ids": [7, 8],
    "meta_info": {
        "id": "r",
        "finish_reason": {"type": "length", "length": 2},
        "prompt_tokens": 2,
        "weight_version": "3",
        "output_token_logprobs": [[-0.5, 7, None], [-0.25, 8, None]],
    },
}


@asynccontextmanager
async def fault_server(routes: dict):
    app = web.Application()
    calls: list[str] = []

    def make(path, behaviour):
        async def handler(request: web.Request) -> web.StreamResponse:
            calls.append(path)
            return behaviour(calls.count(path))  # a fresh response per call

        return handler

    for path, behaviour in routes.items():
        app.router.add_route("*", path, make(path, behaviour))
    async with serve_app(app) as url:
        yield url, calls


async def test_503_while_starting_is_retried_then_succeeds():
    def generate(n):
        if n <= 2:
            return web.json_response({"error": "starting"}, status=503)
        return web.json_response(OK_GENERATE)

    async with fault_server({"/generate": generate}) as (url, calls):
        client = SGLangClient(url, max_retries=3, backoff_s=0.01)
        out = await client.generate(GenerateRequest([1, 2], SamplingParams(2)))
        await client.close()
    assert calls.count("/generate") == 3
    assert (out.output_ids, out.output_logprobs, out.weight_version) == ([7, 8], [-0.5, -0.25], 3)


async def test_4xx_is_raised_at_once_with_the_server_error():
    def bad(_):
        return web.json_response({"error": "unknown sampling_params keys ['x']"}, status=400)

    async with fault_server({"/generate": bad}) as (url, calls):
        client = SGLangClient(url, max_retries=5, backoff_s=1.0)
        start = time.monotonic()
        with pytest.raises(InvalidRequest, match=r"unknown sampling_params keys \['x'\]"):
            await client.generate(GenerateRequest([1, 2], SamplingParams(2)))
        await client.close()
    assert calls == ["/generate"] and time.monotonic() - start < 1.0


async def test_persistent_5xx_gives_up_after_bounded_retries():
    def boom(_):
        return web.json_response({"error": "boom"}, status=500)

    async with fault_server({"/generate": boom}) as (url, calls):
        client = SGLangClient(url, max_retries=2, backoff_s=0.01)
        with pytest.raises(EngineError, match=r"failed after 3 attempts.*HTTP 500"):
            await client.generate(GenerateRequest([1, 2], SamplingParams(2)))
        await client.close()
    assert calls.count("/generate") == 3


async def test_refit_version_mismatch_is_an_error_and_generation_continues():
    def ok(_):
        return web.json_response({"success": True, "status": "ok", "message": ""})

    def busy_once(n):
        return web.json_response({"error": "busy"}, status=400) if n == 1 else web.Response()

    routes = {
        "/model_info": lambda _: web.json_response({"weight_version": "5"}),  # never moves: broken update
        "/pause_generation": ok,
        "/flush_cache": busy_once,
        "/update_weights_from_disk": ok,
        "/continue_generation": ok,
    }
    async with fault_server(routes) as (url, calls):
        client = SGLangClient(url, max_retries=0)
        with pytest.raises(EngineError, match="reports weight version 5, expected 6"):
            await client.update_weights_from_disk("/some/ckpt")
        await client.close()
    order = [c for c in calls if c != "/model_info"]
    assert order == [
        "/pause_generation",
        "/flush_cache",  # 400 while requests settle: retried
        "/flush_cache",
        "/update_weights_from_disk",
        "/continue_generation",
    ]


async def test_engine_errors_are_classified_retryable_or_not():
    """4xx and a malformed URL: not retryable (a strategy fails the group at once); connection
    errors and 5xx after the bounded retries: retryable (the group may be resubmitted)."""

    def bad(_):
        return web.json_response({"error": "prompt too long"}, status=400)

    def unavailable(_):
        return web.json_response({"error": "overloaded"}, status=503)

    async with fault_server({"/generate": bad, "/health": unavailable}) as (url, _):
        client = SGLangClient(url, max_retries=1, backoff_s=0.01)
        with pytest.raises(InvalidRequest) as refused:
            await client.generate(GenerateRequest([1, 2], SamplingParams(2)))
        with pytest.raises(EngineError) as busy:
            await client._call("GET", "/health")
        await client.close()
    assert refused.value.retryable is False and busy.value.retryable is True
    bad_url = SGLangClient("not a url", max_retries=3, backoff_s=1.0)
    start = time.monotonic()
    with pytest.raises(InvalidRequest, match="not a valid URL") as info:
        await bad_url.generate(GenerateRequest([1, 2], SamplingParams(2)))
    await bad_url.close()
    assert info.value.retryable is False and time.monotonic() - start < 1.0
