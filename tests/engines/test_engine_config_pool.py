"""Engine configs (chosen by type) → build_engine, the EnginePool fan-out, and the server's injected latency."""

from __future__ import annotations

import asyncio
import importlib.util
import time

import aiohttp
import pytest
from aiohttp import web
from pydantic import ValidationError

from verst.rollout.engine import GenerateRequest, InferenceEngine, SamplingParams
from verst.rollout.engines.config import ENGINES, build_engine
from verst.rollout.engines.config import parse_engine_config as EngineConfig
from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.engines.pool import EnginePool
from verst.rollout.engines.serve.server import LatencyInjection, build_app, make_parser
from verst.rollout.engines.sglang.client import SGLangClient
from verst.rollout.engines.sglang.launcher import free_port
from verst.rollout.errors import ConfigError, MissingOptionalDependency


def test_config_is_strict_and_documented():
    with pytest.raises(ValidationError):
        EngineConfig(type="trtllm")
    with pytest.raises(ValidationError):
        EngineConfig(unknown_key=1)
    assert all(f.description for m in ENGINES.builtins.values() for f in m.model_fields.values())


async def test_build_embedded_pool_fans_out(tiny_checkpoint):
    pool = await build_engine(
        EngineConfig(type="embedded", model_path=str(tiny_checkpoint), device="cpu", num_engines=2),
        max_concurrency=8,
    )
    assert isinstance(pool, EnginePool) and isinstance(pool, InferenceEngine)
    try:
        long = SamplingParams(200, ignore_eos=True)
        tasks = [asyncio.ensure_future(pool.generate(GenerateRequest([1, 5, 6], long))) for _ in range(4)]
        while sum(e.load()["num_running_reqs"] for e in pool.engines) < 4:
            await asyncio.sleep(0.005)
        assert all(e.load()["num_running_reqs"] == 2 for e in pool.engines)  # balanced
        await pool.abort()
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert all(o.finish_reason == "abort" for o in outs)
        state = pool.engines[0].model.state_dict()
        assert await pool.update_weights_from_tensors({"lm_head.weight": state["lm_head.weight"]}) == 1
        assert [await e.get_weight_version() for e in pool.engines] == [1, 1]
        assert await pool.health()
    finally:
        await pool.close()


async def test_build_sglang_clients_and_config_errors():
    one = await build_engine(EngineConfig(type="sglang", urls=["http://h:1"]), max_concurrency=8)
    assert isinstance(one, SGLangClient) and one.http_settings.max_connections == 8
    two = await build_engine(
        EngineConfig(type="sglang", urls=["http://h:1", "http://h:2"]), max_concurrency=8
    )
    assert isinstance(two, EnginePool) and [c.http_settings.max_connections for c in two.engines] == [4, 4]
    routed = await build_engine(EngineConfig(type="sglang", router_url="http://r:1"), max_concurrency=8)
    assert isinstance(routed, SGLangClient) and routed.router
    with pytest.raises(ConfigError, match=r"engine\.urls"):
        await build_engine(EngineConfig(type="sglang"), max_concurrency=8)
    with pytest.raises(ConfigError, match=r"engine\.model_path"):
        await build_engine(EngineConfig(type="embedded"), max_concurrency=8)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
async def test_sglang_launch_without_sglang_names_the_extra():
    with pytest.raises(MissingOptionalDependency, match="uv sync --extra sglang"):
        await build_engine(EngineConfig(type="sglang_launch", model_path="/m"), max_concurrency=8)


def test_serve_cli_parses():
    args = make_parser().parse_args(["--model", "/m", "--port", "1234", "--inject-latency-ms", "50"])
    assert (args.model, args.port, args.host, args.inject_latency_ms) == ("/m", 1234, "127.0.0.1", 50.0)


async def test_injected_latency_delays_and_aborts(tiny_checkpoint):
    engine = EmbeddedEngine.from_pretrained(tiny_checkpoint)
    runner = web.AppRunner(build_app(engine, latency=LatencyInjection(mean_ms=400, fraction=1.0, seed=1)))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}"
    try:
        body = {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 2}, "rid": "slow-1"}
        async with aiohttp.ClientSession() as s:
            start = time.monotonic()
            async with s.post(url + "/generate", json=body) as r:
                assert r.status == 200 and len((await r.json())["output_ids"]) >= 1
            assert time.monotonic() - start >= 0.2  # uniform 0.5-1.5 x 400 ms
            task = asyncio.ensure_future(s.post(url + "/generate", json={**body, "rid": "slow-2"}))
            await asyncio.sleep(0.05)
            async with s.post(url + "/abort_request", json={"rid": "slow-2"}) as r:
                assert r.status == 200
            resp = await asyncio.wait_for(task, 5)
            data = await resp.json()
            assert data["meta_info"]["finish_reason"]["type"] == "abort" and data["output_ids"] == []
    finally:
        await runner.cleanup()
