"""SGLang 0.5.23's refit/abort/memory protocol, as `verst serve` enforces it and the client follows it.

`verst serve` (in-process on this test's loop, tiny model) refuses what a real SGLang 0.5.23
server refuses — tensor/distributed updates outside a begin/end session, prefix aborts (a rid is
looked up exactly), generating on released memory — so each test fails if the client regresses.
The wire is observed with a recording middleware (what the server received, in order).
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch
from serve_testlib import serve

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.common.errors import InvalidRequest
from verst.rollout.engines.sglang.client import (
    SGLangClient,
    error_message,
    serialize_named_tensors,
    worker_urls,
)

PROMPT = [1, 8, 9, 10, 11, 12]


async def post(url: str, path: str, body) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, await r.json(content_type=None)


async def loads(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(url + "/v1/loads") as r:
        return (await r.json())["loads"][0]


async def wait_running(url: str, n: int) -> None:
    for _ in range(2000):
        if (await loads(url))["num_running_reqs"] >= n:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{n} requests never ran")


@pytest.fixture(scope="module")
def head(tiny_checkpoint):
    from safetensors.torch import load_file

    return load_file(str(tiny_checkpoint / "model.safetensors"))["lm_head.weight"]


async def test_tensor_updates_need_a_session_and_the_client_opens_one(tiny_checkpoint, head):
    record: list = []
    async with serve(tiny_checkpoint, record=record) as url:
        blob = serialize_named_tensors({"lm_head.weight": head})
        status, body = await post(url, "/update_weights_from_tensor", {"serialized_named_tensors": [blob]})
        assert status == 400 and body["success"] is False
        assert "must run between begin_weight_update() and end_weight_update()" in body["message"]
        status, body = await post(url, "/end_weight_update", {})
        assert status == 400 and "no weight-update session is open" in body["message"]

        client = SGLangClient(url, bucket_bytes=head.numel() * 4 // 2, abort_resend_s=0)
        try:
            named = {"lm_head.weight": head * 2, "model.norm.weight": torch.ones(head.shape[1])}
            record.clear()
            assert await client.update_weights_from_tensors(named, weight_version=4) == 4
        finally:
            await client.close()
        paths = [p for p, _ in record]
        assert paths == [
            "/pause_generation",
            "/flush_cache",
            "/begin_weight_update",
            "/update_weights_from_tensor",  # one bucket per tensor here
            "/update_weights_from_tensor",
            "/end_weight_update",
            "/continue_generation",
        ]
        updates = [b for p, b in record if p == "/update_weights_from_tensor"]
        assert [u["flush_cache"] for u in updates] == [False, True]  # flush once, at the end
        assert [u.get("weight_version") for u in updates] == [None, "4"]
        # the session is closed again: a bare update is refused
        status, _ = await post(url, "/update_weights_from_tensor", {"serialized_named_tensors": [blob]})
        assert status == 400


async def test_weight_version_is_default_until_set_and_reads_as_zero(tiny_checkpoint, tmp_path):
    async with serve(tiny_checkpoint) as url:
        client = SGLangClient(url)
        try:
            async with aiohttp.ClientSession() as s, s.get(url + "/model_info") as r:
                assert (await r.json())["weight_version"] == "default"
            assert await client.get_weight_version() == 0
            out = await client.generate(GenerateRequest(PROMPT, SamplingParams(2)))
            assert out.weight_version == 0
            # an update without a version keeps it (SGLang does not count), with one sets it
            status, body = await post(url, "/update_weights_from_disk", {"model_path": str(tiny_checkpoint)})
            assert status == 200 and body["weight_version"] == "default"
            assert await client.update_weights_from_disk(str(tiny_checkpoint)) == 1
            assert (await client.generate(GenerateRequest(PROMPT, SamplingParams(2)))).weight_version == 1
        finally:
            await client.close()


async def test_abort_is_exact_and_the_client_aborts_each_rid(tiny_checkpoint):
    async with serve(tiny_checkpoint) as url:
        client = SGLangClient(url, abort_resend_s=0.05)
        long = SamplingParams(200, ignore_eos=True)
        try:
            tasks = {
                rid: asyncio.ensure_future(client.generate(GenerateRequest([1, 5], long, rid=rid)))
                for rid in ("roll-7-0", "roll-7-1", "other-0")
            }
            await wait_running(url, 3)
            # a prefix matches nothing on the server, and an empty rid is ignored
            assert (await post(url, "/abort_request", {"rid": "roll-7-", "abort_all": False}))[0] == 200
            assert (await post(url, "/abort_request", {"rid": "", "abort_all": False}))[0] == 200
            await asyncio.sleep(0.05)
            assert not any(t.done() for t in tasks.values())
            await client.abort("roll-7-")  # exact aborts of the two matching rids
            rolled = [await asyncio.wait_for(tasks[r], 30) for r in ("roll-7-0", "roll-7-1")]
            assert not tasks["other-0"].done()  # untouched
            await client.abort("other-0")
            other = await asyncio.wait_for(tasks["other-0"], 30)
        finally:
            await client.close()
        assert [o.finish_reason for o in rolled] == ["abort", "abort"]
        assert other.finish_reason == "abort" and len(other.output_ids) < 200
        assert client._inflight == {}


async def test_abort_is_resent_for_a_request_that_reached_the_server_late(tiny_checkpoint):
    async with serve(tiny_checkpoint) as url:
        # re-sends at 0.05, 0.1, 0.2 s: the first lands while the 200-token request is running
        client = SGLangClient(url, abort_resend_s=0.05)
        try:
            client._inflight["late-0"] = 1  # sent, but not at the server yet when the abort goes out
            await client.abort("late-")  # returns at once; the exact abort matched nothing
            long = SamplingParams(200, ignore_eos=True)
            out = await asyncio.wait_for(client.generate(GenerateRequest([1, 5], long, rid="late-0")), 30)
            assert out.finish_reason == "abort" and len(out.output_ids) < 200  # the re-send caught it
        finally:
            await client.close()


async def test_errors_come_back_in_sglang_shapes(tiny_checkpoint):
    async with serve(tiny_checkpoint) as url:
        status, body = await post(url, "/generate", {"input_ids": [1], "sampling_params": {"bogus": 1}})
        # a schema error: sglang 0.5.23's contract gate answers {"error": "<text>"}
        assert status == 400 and set(body) == {"error"} and "bogus" in body["error"]
        assert "bogus" in error_message(body)
        status, body = await post(url, "/pause_generation", {"mode": "sideways"})
        assert status == 400 and body["object"] == "error" and body["code"] == 400
        assert "sideways" in error_message(body)
        client = SGLangClient(url)
        try:
            with pytest.raises(InvalidRequest, match="sideways"):
                await client._call("POST", "/pause_generation", {"mode": "sideways"})
        finally:
            await client.close()


async def test_release_resume_protocol(tiny_checkpoint, head):
    async with serve(tiny_checkpoint) as url:
        client = SGLangClient(url, abort_resend_s=0)
        try:
            busy = asyncio.ensure_future(
                client.generate(GenerateRequest([1, 5], SamplingParams(200, ignore_eos=True)))
            )
            await wait_running(url, 1)
            status, body = await post(url, "/release_memory_occupation", {"tags": None})
            assert status == 400 and "idle" in body["message"]  # SGLang asserts the server is idle
            await client.abort()
            await busy
            # KV cache only: weights stay valid, generation works after resume
            await client.release_memory_occupation(["kv_cache", "cuda_graph"])
            with pytest.raises(InvalidRequest, match="released"):
                await client.generate(GenerateRequest(PROMPT, SamplingParams(2)))
            await client.resume_memory_occupation(["kv_cache", "cuda_graph"])
            await client.generate(GenerateRequest(PROMPT, SamplingParams(2)))
            # no tags = weights too; without a CPU backup they do not come back by themselves
            await client.release_memory_occupation()
            with pytest.raises(InvalidRequest, match="released"):
                await client.update_weights_from_tensors({"lm_head.weight": head})
            await client.resume_memory_occupation()
            with pytest.raises(InvalidRequest, match="cpu-backup"):
                await client.generate(GenerateRequest(PROMPT, SamplingParams(2)))
            await client.update_weights_from_tensors({"lm_head.weight": head})  # a refit restores them
            await client.generate(GenerateRequest(PROMPT, SamplingParams(2)))
        finally:
            await client.close()
    async with serve(tiny_checkpoint, info={"enable_weights_cpu_backup": True}) as url:
        client = SGLangClient(url)
        try:
            await client.release_memory_occupation()
            await client.resume_memory_occupation()
            await client.generate(GenerateRequest(PROMPT, SamplingParams(2)))  # backed up: fine
        finally:
            await client.close()


def test_router_worker_listing_forms():
    # sglang-router 0.3.2 GET /workers; dp-aware workers carry an @rank suffix (one server)
    body = {"workers": [{"url": "http://h:1@0"}, {"url": "http://h:1@1"}, {"url": "http://h:2"}], "total": 3}
    assert worker_urls(body) == ["http://h:1", "http://h:2"]
    assert worker_urls({"urls": ["http://h:1/", "http://h:2"]}) == ["http://h:1", "http://h:2"]
    assert worker_urls([{"url": "http://h:3@0", "worker_id": "a"}]) == ["http://h:3"]
    assert worker_urls({"something": 1}) is None


def test_cpu_tensors_pickled_by_value_cuda_ipc_patch_is_idempotent():
    import base64
    import pickle

    from torch.multiprocessing import reductions

    from verst.rollout.engines.common import cuda_ipc

    t = torch.arange(6.0).view(2, 3)[:, 1:]  # non-contiguous: sent contiguous
    back = dict(pickle.loads(base64.b64decode(serialize_named_tensors({"w": t}))))
    assert torch.equal(back["w"], t)
    cuda_ipc.patch_sender()
    patched = reductions.reduce_tensor
    cuda_ipc.patch_sender()
    assert reductions.reduce_tensor is patched  # idempotent
    assert cuda_ipc.replace_arg((0, 1, 2), 1, lambda x: x * 10) == (0, 10, 2)
    assert cuda_ipc.device_index(3) == 3


def test_sglang_launch_command_per_server_gpus_and_flags():
    from verst.rollout.engines.sglang.launcher import sglang_server_command

    cmds = [
        sglang_server_command("/m", i, host="127.0.0.1", port=30000 + i, tp_size=2, base_gpu_id=1)
        for i in range(3)
    ]

    def flag(cmd, name):
        return cmd[cmd.index(name) + 1]

    assert [flag(c, "--base-gpu-id") for c in cmds] == ["1", "3", "5"]  # base + i * tp_size
    assert {flag(c, "--weight-version") for c in cmds} == {"0"}  # not SGLang's "default"
    assert "--enable-memory-saver" not in cmds[0]
    colocated = sglang_server_command("/m", 0, host="h", port=1, memory_saver=True, deterministic=True)
    for name in ("--enable-memory-saver", "--enable-weights-cpu-backup", "--enable-deterministic-inference"):
        assert name in colocated
