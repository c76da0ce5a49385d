"""`verst serve` under bad requests: every one is a 4xx with a JSON body, answered at once.

The real app (`build_app`) over the embedded engine on the tiny model, on loopback; the
SIGTERM-on-a-busy-server check runs a `verst serve` subprocess in `tests/e2e/test_e2e_rollout_faults.py`.
"""

from __future__ import annotations

import time

import aiohttp
import pytest
from aiohttp import web

from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.engines.serve.server import build_app
from verst.rollout.engines.sglang.client import error_message
from verst.rollout.engines.sglang.launcher import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture()
async def url(tiny_checkpoint):
    runner = web.AppRunner(
        build_app(EmbeddedEngine.from_pretrained(tiny_checkpoint), max_request_tokens=4096)
    )
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def post(url: str, data: str) -> tuple[int, object, float]:
    start = time.monotonic()
    async with aiohttp.ClientSession() as s, s.post(f"{url}/generate", data=data) as resp:
        body = await resp.json(content_type=None)
        return resp.status, body, time.monotonic() - start


def generate(sp: str) -> str:
    return '{"input_ids": [1, 2, 3], "sampling_params": {' + sp + "}}"


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (generate('"temperature": NaN, "max_new_tokens": 2'), 400, "temperature must be a finite number"),
        (
            generate('"temperature": Infinity, "max_new_tokens": 2'),
            400,
            "temperature must be a finite number",
        ),
        (
            generate(f'"sampling_seed": {2**70}, "max_new_tokens": 2'),
            400,
            "sampling_seed must fit in 64 bits",
        ),
        ("[" * 200_000 + "]" * 200_000, 400, "nested too deeply"),
        (generate('"n": 1000000, "max_new_tokens": 128'), 413, "--max-request-tokens 4096"),
        (
            '{"input_ids": [[1], [2]], "sampling_params": {"n": 16, "max_new_tokens": 200}}',
            413,
            "6400 tokens",
        ),
    ],
    ids=["nan-temperature", "inf-temperature", "seed-past-64-bits", "deep-nesting", "huge-n", "batch-x-n"],
)
async def test_bad_requests_are_4xx_with_a_json_error(url, body, status, needle):
    code, payload, elapsed = await post(url, body)
    assert code == status, payload
    # SGLang's shapes: {"error": {"message"}} from /generate, an ErrorResponse for bad JSON
    assert isinstance(payload, dict) and needle in str(error_message(payload))
    assert elapsed < 5, "refused before anything was queued"


async def test_requests_within_the_bound_are_served(url):
    code, payload, _ = await post(url, generate(f'"n": 2, "max_new_tokens": 3, "sampling_seed": {2**64 - 1}'))
    assert code == 200 and len(payload) == 2
