"""`verst serve` under bad requests: every one is a 4xx with a JSON body, answered at once.

The real app (`build_app`) over the embedded engine on the tiny model, on loopback; the
SIGTERM-on-a-busy-server check runs a `verst serve` subprocess in `tests/e2e/test_e2e_rollout_faults.py`.
"""

from __future__ import annotations

import time

import aiohttp
import pytest
from serve_testlib import serve_app

from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.engines.serve.server import build_app
from verst.rollout.engines.sglang.client import error_message

pytestmark = pytest.mark.timeout(60)


@pytest.fixture()
async def url(tiny_checkpoint):
    app = build_app(EmbeddedEngine.from_pretrained(tiny_checkpoint), max_request_tokens=4096)
    async with serve_app(app) as base:
        yield base


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
        (generate('"n": 1000000, "max_new_tokens": 128'), 413, "--max-request-sequences 4096"),
        (
            '{"input_ids": [[1], [2]], "sampling_params": {"n": 16, "max_new_tokens": 200}}',
            413,
            "6432 tokens",
        ),
        # #25 item 7: the prompts count too (40 x 2 x (100 + 2) tokens; new tokens alone: 160)
        (
            '{"input_ids": ' + str([[1] * 100] * 40) + ', "sampling_params": {"n": 2, "max_new_tokens": 2}}',
            413,
            "8160 tokens",
        ),
    ],
    ids=[
        "nan-temperature",
        "inf-temperature",
        "seed-past-64-bits",
        "deep-nesting",
        "huge-n",
        "batch-x-n",
        "prompt-tokens-count",
    ],
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


@pytest.fixture()
async def default_url(tiny_checkpoint):
    """The app with `verst serve`'s default bounds."""
    async with serve_app(build_app(EmbeddedEngine.from_pretrained(tiny_checkpoint))) as base:
        yield base


async def test_a_million_sequences_of_one_token_are_refused_by_the_default_bounds(default_url):
    """#25 item 7: the bound counted new tokens only, so n = 1,000,000 x max_new_tokens = 1 was
    accepted (1e6 < 1 << 20) and starved every other client."""
    code, payload, elapsed = await post(default_url, generate('"n": 1000000, "max_new_tokens": 1'))
    assert code == 413 and "1000000 sequences" in str(error_message(payload)), payload
    assert "--max-request-sequences 4096" in str(error_message(payload)) and elapsed < 5
    code, payload, _ = await post(default_url, generate('"n": 2, "max_new_tokens": 2'))
    assert code == 200 and len(payload) == 2  # and the server still serves


@pytest.mark.parametrize(
    ("sp", "needle"),
    [
        ('"bogus": 1', "unknown sampling_params keys ['bogus']"),
        ('"max_new_tokens": "many"', "sampling_params.max_new_tokens must be int"),
    ],
)
async def test_schema_errors_answer_a_string_error_like_sglang(url, sp, needle):
    """#25 item 8: SGLang 0.5.23's contract gate answers schema errors with 400
    `{"error": "<text>"}` (a string); other refusals keep `{"error": {"message"}}`."""
    code, payload, _ = await post(url, generate(sp))
    assert code == 400 and set(payload) == {"error"} and isinstance(payload["error"], str), payload
    assert needle in payload["error"] and error_message(payload) == payload["error"]
    code, payload, _ = await post(url, '{"input_ids": [1], "text": "x"}')  # not a schema error
    assert code == 400 and isinstance(payload["error"], dict) and "exactly one of" in error_message(payload)
