"""The SGLang client over real HTTP on loopback against `verst serve` subprocesses (tiny model).

Set `VERST_TEST_SGLANG_URL` (and `VERST_TEST_SGLANG_MODEL`, the model directory the server
can read) to run the same tests against a real SGLang server (scripts/gpu_check.sh, its sglang stage);
the tests that must kill or stand in for our own processes then skip.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from contextlib import asynccontextmanager

import aiohttp
import pytest
import torch
from aiohttp import web
from serve_testlib import serve_app

from verst.rollout.engine import EngineError, GenerateRequest, SamplingParams
from verst.rollout.engines.common.errors import InvalidRequest
from verst.rollout.engines.common.http import error_message
from verst.rollout.engines.sglang.client import SGLangClient
from verst.rollout.engines.sglang.launcher import free_port, launch_verst_servers

EXTERNAL_URL = os.environ.get("VERST_TEST_SGLANG_URL")
EXTERNAL_MODEL = os.environ.get("VERST_TEST_SGLANG_MODEL")
needs_own_servers = pytest.mark.skipif(
    bool(EXTERNAL_URL), reason="kills or fronts our own verst serve processes"
)


class _External:
    """An externally started server (a real SGLang one)."""

    def __init__(self) -> None:
        self.urls = [EXTERNAL_URL]
        self.servers: list = []


@pytest.fixture(scope="module")
def servers(tiny_checkpoint, tmp_path_factory):
    if EXTERNAL_URL:
        yield _External()
        return
    # one `verst serve` subprocess for the module; the last test kills it
    logs = tmp_path_factory.mktemp("serve-logs")
    with launch_verst_servers(tiny_checkpoint, extra_args=["--num-threads", "1"], log_dir=logs) as s:
        yield s


@asynccontextmanager
async def in_process_server(model_dir):
    """`verst serve`'s app on this test's event loop (a second worker for the router test)."""
    from verst.rollout.engines.embedded.engine import EmbeddedEngine
    from verst.rollout.engines.serve.server import build_app

    async with serve_app(build_app(EmbeddedEngine.from_pretrained(model_dir))) as url:
        yield url


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint):
    return EXTERNAL_MODEL or str(tiny_checkpoint)


@pytest.fixture(scope="module")
def reference_model(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


@asynccontextmanager
async def client_for(url: str, **kwargs):
    client = SGLangClient(url, **kwargs)
    try:
        yield client
    finally:
        await client.close()


async def wait_running(url: str, n: int = 1) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(2000):
            async with s.get(url + "/v1/loads") as r:
                if (await r.json())["loads"][0]["num_running_reqs"] >= n:
                    return
            await asyncio.sleep(0.005)
    raise AssertionError("request never started running")


PROMPT = [1, 8, 9, 10, 11, 12]


async def test_generate_tokens_and_logprobs_match_full_forward(servers, reference_model):
    async with client_for(servers.urls[0]) as c:
        assert await c.health()
        out = await c.generate(
            GenerateRequest(PROMPT, SamplingParams(12, temperature=0.8, ignore_eos=True, sampling_seed=3))
        )
        assert len(out.output_ids) == len(out.output_logprobs) == 12 and out.finish_reason == "length"
        assert out.prompt_tokens == len(PROMPT)
        again = await c.generate(
            GenerateRequest(PROMPT, SamplingParams(12, temperature=0.8, ignore_eos=True, sampling_seed=3))
        )
        assert again.output_ids == out.output_ids  # seeded over HTTP too
    if EXTERNAL_URL:
        return
    with torch.no_grad():
        logits = reference_model(torch.tensor([PROMPT + out.output_ids])).logits[0]  # [seq, vocab]
    lp = torch.log_softmax(logits / 0.8, -1)[len(PROMPT) - 1 : -1]
    ref = lp.gather(-1, torch.tensor(out.output_ids)[:, None])[:, 0]
    assert (ref - torch.tensor(out.output_logprobs)).abs().max() < 1e-4


async def test_batch_generate_and_scoring(servers):
    async with client_for(servers.urls[0]) as c:
        reqs = [GenerateRequest(PROMPT[: 3 + i], SamplingParams(3 + i, ignore_eos=True)) for i in range(3)]
        outs = await c.generate_batch(reqs)
        assert [len(o.output_ids) for o in outs] == [3, 4, 5]
        score = await c.generate(
            GenerateRequest(
                PROMPT, SamplingParams(0), logprob_start_len=0, top_logprobs_num=2, token_ids_logprob=[5]
            )
        )
        assert score.output_ids == [] and score.input_logprobs[0] is None
        assert len(score.input_logprobs) == len(PROMPT) and all(x < 0 for x in score.input_logprobs[1:])
        assert len(score.input_top_logprobs[1]) == 2 and score.input_token_ids_logprobs[1][0][1] == 5


async def test_streaming_sse(servers):
    body = {"input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    async with aiohttp.ClientSession() as s, s.post(servers.urls[0] + "/generate", json=body) as r:
        assert r.status == 200
        events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(chunks[-1]["output_ids"]) == 5


async def test_abort_in_flight_request_returns_partial_output(servers):
    url = servers.urls[0]
    async with client_for(url) as c:
        req = GenerateRequest([1, 5], SamplingParams(240, ignore_eos=True), rid="abort-me-1")
        task = asyncio.ensure_future(c.generate(req))
        await wait_running(url)
        await c.abort("abort-me")
        out = await asyncio.wait_for(task, 20)
        assert out.finish_reason == "abort" and 0 < len(out.output_ids) < 240
        assert len(out.output_logprobs) == len(out.output_ids)


async def test_weight_update_from_disk_checks_version(servers, model_path):
    async with client_for(servers.urls[0]) as c:
        v0 = await c.get_weight_version()
        assert await c.update_weights_from_disk(model_path) == v0 + 1
        out = await c.generate(GenerateRequest(PROMPT, SamplingParams(2)))
        assert out.weight_version == v0 + 1
        assert await c.update_weights_from_disk(model_path, weight_version=v0 + 10) == v0 + 10
        assert await c.get_weight_version() == v0 + 10
        with pytest.raises(InvalidRequest):
            await c.update_weights_from_disk("/nonexistent/checkpoint")
        # the refit resumed generation even though the update failed
        out = await asyncio.wait_for(c.generate(GenerateRequest(PROMPT, SamplingParams(2))), 20)
        assert out.weight_version == v0 + 10


@needs_own_servers
async def test_weight_update_from_tensors(servers, reference_model):
    async with client_for(servers.urls[0]) as c:
        v = await c.get_weight_version()
        head = reference_model.lm_head.weight.detach()
        assert await c.update_weights_from_tensors({"lm_head.weight": head * 2.0}) == v + 1
        greedy = SamplingParams(6, temperature=0.0, ignore_eos=True)
        doubled = await c.generate(GenerateRequest(PROMPT, greedy))
        assert await c.update_weights_from_tensors({"lm_head.weight": head}) == v + 2
        restored = await c.generate(GenerateRequest(PROMPT, greedy))
        assert doubled.output_ids == restored.output_ids  # argmax unchanged by scaling
        assert doubled.output_logprobs != pytest.approx(restored.output_logprobs, abs=1e-3)


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{not json", "malformed JSON"),
        (json.dumps({"input_ids": "abc"}).encode(), "input_ids"),
        (json.dumps({"input_ids": [1, 2], "return_logprob": "yes"}).encode(), "return_logprob"),
        (
            json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "5"}}).encode(),
            "max_new_tokens",
        ),
        (json.dumps({"input_ids": [1, 2], "sampling_params": {"bogus_key": 1}}).encode(), "bogus_key"),
        (json.dumps({"input_ids": [1] * 100_000}).encode(), "context"),
    ],
)
async def test_bad_requests_get_4xx_json(servers, body, fragment):
    url = servers.urls[0]
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/generate", data=body, headers={"Content-Type": "application/json"}) as r:
            assert 400 <= r.status < 500
            err = await r.json(content_type=None)
        # SGLang 0.5.23's shapes: {"error": "<text>"} (a /generate schema error), {"error": {"message"}}
        # (other /generate refusals) or an ErrorResponse {"object": "error"}; the client reads all three
        shaped = isinstance(err.get("error"), (dict, str)) or err.get("object") == "error"
        assert shaped and error_message(err), err
        assert EXTERNAL_URL or fragment in json.dumps(err)
        async with s.get(url + "/health") as r:
            assert r.status == 200  # still serving


async def test_client_does_not_retry_4xx(servers):
    async with client_for(servers.urls[0], max_retries=5, backoff_s=1.0) as c:
        start = time.monotonic()
        with pytest.raises(InvalidRequest, match="400"):
            await c.generate(GenerateRequest([1] * 100_000, SamplingParams(2)))
        assert time.monotonic() - start < 1.0  # a retry would have slept >= 1 s


@asynccontextmanager
async def stand_in_router(workers: list[str], *, old_form: bool):
    """Simulates the external sglang-router's worker listing (old or new API)."""

    async def list_workers(_: web.Request) -> web.Response:  # router <= 0.2.1
        return web.json_response({"urls": workers})

    async def workers_new(_: web.Request) -> web.Response:  # newer gateway
        return web.json_response({"workers": [{"url": u} for u in workers], "total": len(workers)})

    app = web.Application()
    if old_form:
        app.router.add_get("/list_workers", list_workers)
    else:
        app.router.add_get("/workers", workers_new)
    async with serve_app(app) as url:
        yield url


@needs_own_servers
@pytest.mark.parametrize("old_form", [True, False])
async def test_router_abort_fans_out_to_every_worker(servers, tiny_checkpoint, old_form):
    async with in_process_server(tiny_checkpoint) as second:
        workers = [servers.urls[0], second]
        await _fan_out(workers, old_form)


async def _fan_out(workers: list[str], old_form: bool) -> None:
    async with (
        stand_in_router(workers, old_form=old_form) as router_url,
        client_for(router_url, router=True) as via_router,
    ):
        assert await via_router.workers() == workers
        directs = [SGLangClient(u) for u in workers]
        long = SamplingParams(240, ignore_eos=True)
        tasks = [asyncio.ensure_future(d.generate(GenerateRequest([1, 6], long))) for d in directs]
        for u in workers:
            await wait_running(u)
        await via_router.abort()
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 20)
        assert all(o.finish_reason == "abort" and len(o.output_ids) < 240 for o in outs)
        for d in directs:
            await d.close()
    dead = f"http://127.0.0.1:{free_port()}"
    async with (
        stand_in_router([workers[0], dead], old_form=old_form) as router_url,
        client_for(router_url, router=True, max_retries=1, backoff_s=0.01) as via_router,
    ):
        with pytest.raises(EngineError, match=dead.replace(".", r"\.")):
            await via_router.abort()


async def _length_reward(sample) -> float:
    return float(sample.response_length)


async def _rollout(engine, tokenizer, data_path):
    from verst.rollout.config import DataConfig, RolloutConfig
    from verst.rollout.data import PromptDataSource
    from verst.rollout.protocols import RolloutContext, RolloutRequest
    from verst.rollout.strategies.inference import InferenceRollout

    cfg = RolloutConfig(batch_size=2, n_samples_per_prompt=2, max_response_len=6, temperature=0.0)
    source = PromptDataSource(DataConfig(path=str(data_path), shuffle=False), 2, tokenizer=tokenizer)
    ctx = RolloutContext(
        config=cfg, data_source=source, engine=engine, tokenizer=tokenizer, reward_fn=_length_reward
    )
    return await InferenceRollout(ctx)(RolloutRequest(rollout_id=0))


@needs_own_servers
async def test_default_rollout_same_samples_in_process_and_over_http(servers, tiny_checkpoint, tmp_path):
    """The default strategy against the embedded engine and against `verst serve` via the client."""
    from verst.rollout.engines.embedded.engine import EmbeddedEngine

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["1+1=", "2+3=", "4+4="]))
    local = EmbeddedEngine.from_pretrained(tiny_checkpoint)
    try:
        results = [await _rollout(local, local.tokenizer, data)]
        async with client_for(servers.urls[0]) as remote:
            version = await remote.get_weight_version()
            results.append(await _rollout(remote, local.tokenizer, data))
    finally:
        await local.close()
    shapes = []
    for result in results:
        samples = [s for g in result.groups for s in g]
        for s in samples:
            s.validate()
            assert s.status.is_finished and len(s.rollout_logprobs) == s.response_length > 0
        shapes.append([(s.prompt, s.tokens, s.response_length, s.status) for s in samples])
    assert shapes[0] == shapes[1]  # greedy: the same tokens through both paths
    local_lps = [s.rollout_logprobs for g in results[0].groups for s in g]
    remote_lps = [s.rollout_logprobs for g in results[1].groups for s in g]
    for a, b in zip(local_lps, remote_lps, strict=True):
        assert a == pytest.approx(b, abs=1e-4)
    assert {v for g in results[1].groups for s in g for v in s.weight_versions} == {version}


@needs_own_servers
async def test_server_killed_mid_request_fails_after_bounded_retries(servers):
    victim = servers.servers[0]
    async with client_for(victim.url, max_retries=3, backoff_s=0.05, connect_timeout_s=1.0) as c:
        task = asyncio.ensure_future(
            c.generate(GenerateRequest([1, 7], SamplingParams(240, ignore_eos=True)))
        )
        await wait_running(victim.url)
        victim.process.send_signal(signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineError, match="failed after 4 attempts"):
            await asyncio.wait_for(task, 30)
        elapsed = time.monotonic() - start
        assert elapsed < 5.0  # backoff 0.05 + 0.1 + 0.2, plus refused connections
