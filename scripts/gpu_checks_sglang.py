"""The sglang stage of `scripts/gpu_check.py`: real SGLang 0.5.23 servers and the router with
verst's client (or, `--sglang-server verst`, the same client calls against `verst serve` on CPU:
a rehearsal; the tensor refit then sends CPU tensors by value instead of CUDA IPC handles).

Two servers on GPU 0 (memory saver + weights CPU backup; the second with
--enable-deterministic-inference) and the client against them: the client test suite,
log-probs vs HF, "default" version, exact-rid abort, refit from disk / tensors (CUDA IPC,
buckets) / distributed (gloo group built like SGLang's, buckets) inside weight-update sessions,
NCCL refused on a shared GPU, release/resume keeps weights, the colocated release -> refit ->
resume order, seeded sampling; sglang-router 0.3.2 in front of both: GET /workers, generate,
abort, refit. Needs the sglang extra (`uv sync --extra sglang`); never runs on the lent image.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gpu_checks import REPO, Recorder, scaled_copy


# ------------------------------------------------------------------------------------ sglang
class Loop:
    """An event loop in a thread (the engine side); `run` blocks like the trainer does."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coro: Any, timeout: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)


def _score(loop: Loop, client: Any, ids: list[int]) -> list[float]:
    from verst.rollout.engine import GenerateRequest, SamplingParams

    out = loop.run(client.generate(GenerateRequest(ids, SamplingParams(0), logprob_start_len=0)))
    return [float(v) for v in out.input_logprobs[1:]]


def _hf_score(model: Path, ids: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(m(torch.tensor([ids])).logits[0].float(), -1)
    return [float(lp[i - 1, t]) for i, t in enumerate(ids) if i > 0]


def _close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def _running(url: str, n: int, timeout: float = 30) -> bool:
    import aiohttp

    end = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < end:
            async with s.get(url + "/v1/loads") as r:
                data = await r.json(content_type=None)
            loads = data.get("loads", [{}]) if isinstance(data, dict) else [{}]
            if sum(int(x.get("num_running_reqs", 0)) for x in loads) >= n:
                return True
            await asyncio.sleep(0.02)
    return False


def launch(kind: str, model: Path, logs: Path, *, deterministic: bool) -> Any:
    """One server of `kind` (sglang: on GPU 0 — one call per server, so each gets
    `--base-gpu-id 0` on a one-GPU box — with the colocated flags; verst: CPU)."""
    from verst.rollout.engines.sglang.launcher import launch_sglang_servers, launch_verst_servers

    if kind == "verst":
        args = ["--dtype", "float32", "--enable-weights-cpu-backup"]  # as the SGLang servers get
        return launch_verst_servers(model, extra_args=args, log_dir=logs)
    return launch_sglang_servers(
        model,
        mem_fraction_static=0.2,
        memory_saver=True,
        deterministic=deterministic,
        extra_args=["--cuda-graph-max-bs-decode", "8", "--log-level", "warning"],  # 0.5.23: the old
        # --cuda-graph-max-bs is an ambiguous prefix of the -decode / -prefill pair
        ready_timeout_s=420,
        log_dir=logs,
    )


def sglang(model: Path, summary: Recorder, kind: str, logs: Path) -> None:
    import torch

    from verst.rollout.engine import GenerateRequest, SamplingParams
    from verst.rollout.engines.sglang.client import SGLangClient
    from verst.rollout.engines.sglang.launcher import LaunchedServers

    pre = "sglang"  # the same check names against `verst serve` (the rehearsal); details say which
    loop = Loop()
    servers = LaunchedServers()
    with summary.check(f"{pre}/launch") as info:
        servers.servers += launch(kind, model, logs / "server0", deterministic=False).servers
        info["detail"] = f"up: {servers.urls}"
    with summary.check(f"{pre}/launch_deterministic") as info:
        servers.servers += launch(kind, model, logs / "server1", deterministic=True).servers
        info["detail"] = f"up with --enable-deterministic-inference: {servers.urls[-1]}"
    if not servers.servers:
        return
    try:
        url = servers.urls[0]
        client = SGLangClient(url, bucket_bytes=1 << 20, abort_resend_s=0.2)
        ids = [1, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
        base = _hf_score(model, ids)
        with summary.check(f"{pre}/fresh_version_reads_0") as info:
            v = loop.run(client.get_weight_version())
            info["detail"] = f"fresh server (launched with --weight-version 0) reports {v}"
            assert v == 0
        with summary.check(f"{pre}/client_suite") as info:
            env = {**os.environ, "VERST_TEST_SGLANG_URL": url, "VERST_TEST_SGLANG_MODEL": str(model)}
            test = "tests/engines/test_engine_sglang_client.py"
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test]
            r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
            tail = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
            info["detail"] = tail
            print(r.stdout[-4000:], r.stderr[-2000:])
            assert r.returncode == 0, tail
        with summary.check(f"{pre}/logprobs_vs_hf") as info:
            got = _score(loop, client, ids)
            err = _close(got, base)
            info["detail"] = f"max |lp - hf| = {err:.3g} over {len(got)} tokens"
            assert err < 5e-2
        with summary.check(f"{pre}/exact_abort") as info:
            long = SamplingParams(6000, ignore_eos=True)
            a = loop.submit(client.generate(GenerateRequest(ids, long, rid="chk-a-0")))
            b = loop.submit(client.generate(GenerateRequest(ids, long, rid="other-0")))
            assert loop.run(_running(url, 2)), "requests never ran"
            loop.run(client._call("POST", "/abort_request", {"rid": "chk-a-", "abort_all": False}))
            time.sleep(0.3)
            assert not a.done() and not b.done(), "a prefix abort stopped a request"
            loop.run(client.abort("chk-a-"))
            out_a = a.result(30)
            assert out_a.finish_reason == "abort" and not b.done(), "exact abort hit the wrong request"
            loop.run(client.abort())
            out_b = b.result(30)
            info["detail"] = (
                f"a: abort after {len(out_a.output_ids)}, b: {out_b.finish_reason} after {len(out_b.output_ids)}"
            )
        scaled = scaled_copy(model, logs / "model_x2", 2.0)
        want_scaled = _hf_score(scaled, ids)
        with summary.check(f"{pre}/refit_disk") as info:
            v = loop.run(client.update_weights_from_disk(str(scaled), 1))
            err = _close(_score(loop, client, ids), want_scaled)
            info["detail"] = f"version {v}, max |lp - hf(x2)| = {err:.3g}"
            assert v == 1 and err < 5e-2
        with summary.check(f"{pre}/refit_tensor_buckets") as info:
            from transformers import AutoModelForCausalLM

            cuda = kind == "sglang"  # CUDA IPC handles; the verst rehearsal sends CPU tensors by value
            m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16 if cuda else torch.float32)
            named = {k: v.detach() for k, v in (m.cuda() if cuda else m).state_dict().items()}
            v = loop.run(client.update_weights_from_tensors(named, 2))
            err = _close(_score(loop, client, ids), base)
            how = "CUDA IPC" if cuda else "CPU tensors by value"
            info["detail"] = (
                f"version {v}, {len(named)} tensors ({how}) in 1 MiB buckets, max |lp - hf| = {err:.3g}"
            )
            assert v == 2 and err < 5e-2
            del m, named
        with summary.check(f"{pre}/refit_distributed_gloo_buckets") as info:
            from transformers import AutoModelForCausalLM

            from verst.trainer.sync.weight_sync import WeightSync
            from verst.trainer.train.fsdp import DistInfo

            hf = AutoModelForCausalLM.from_pretrained(scaled, dtype=torch.float32)
            train = _TrainStub(hf)
            side = _RolloutStub(client, loop)
            sync = WeightSync(
                train, side, mode="distributed", staging_dir=logs / "unused", dist_info=DistInfo(),
                weight_version=loop.run(client.get_weight_version()), backend="gloo", bucket_bytes=1 << 20,
            )  # fmt: skip
            try:
                v = sync.push(3)
                err = _close(_score(loop, client, ids), want_scaled)
                info["detail"] = (
                    f"version {v}, world size {sync.group.world_size}, max |lp - hf(x2)| = {err:.3g}"
                )
                assert v == 3 and err < 5e-2
            finally:
                sync.close()
        with summary.check(f"{pre}/nccl_refused_on_shared_gpu") as info:
            from verst.trainer.sync.weight_sync import WeightSyncError

            sync = WeightSync(
                _TrainStub(None), _RolloutStub(client, loop), mode="distributed", staging_dir=logs,
                dist_info=DistInfo(), backend="nccl", shares_gpu_with_engine=True,
            )  # fmt: skip
            try:
                sync.transport.ensure_group(sync.rollout)
                raise AssertionError("NCCL on a shared GPU was not refused")
            except WeightSyncError as exc:
                info["detail"] = str(exc)[:120]
        with summary.check(f"{pre}/release_resume_keeps_weights") as info:
            before = _score(loop, client, ids)
            loop.run(client.release_memory_occupation())
            loop.run(client.resume_memory_occupation())
            err = _close(_score(loop, client, ids), before)
            info["detail"] = f"max |lp after - before| = {err:.3g}"
            assert err < 1e-4
        with summary.check(f"{pre}/colocated_order_release_refit_resume") as info:
            from verst.trainer.sync.colocate import ColocatedMemory

            memory = ColocatedMemory(client, loop.run, colocated=True)
            memory.before_generate()
            loop.run(client.generate(GenerateRequest(ids, SamplingParams(4))))
            memory.after_rollout()
            memory.before_refit()
            v = loop.run(client.update_weights_from_disk(str(model), 4))
            memory.after_refit()
            err = _close(_score(loop, client, ids), base)
            info["detail"] = f"version {v}, max |lp - hf| = {err:.3g}"
            assert v == 4 and err < 5e-2
        loop.run(client.close())
        with summary.check(f"{pre}/sampling_seed_with_deterministic_inference") as info:
            assert len(servers.urls) == 2, "the deterministic server did not start"
            det = SGLangClient(servers.urls[1])
            sp = SamplingParams(16, temperature=1.0, ignore_eos=True, sampling_seed=7)
            one = loop.run(det.generate(GenerateRequest(ids, sp)))
            two = loop.run(det.generate(GenerateRequest(ids, sp)))
            loop.run(det.close())
            info["detail"] = "same tokens" if one.output_ids == two.output_ids else "differ"
            assert one.output_ids == two.output_ids
        if kind == "sglang" and len(servers.urls) == 2:
            router(servers.urls, summary, loop, logs, model)
    finally:
        servers.close()


def router(urls: list[str], summary: Recorder, loop: Loop, logs: Path, model: Path) -> None:
    from verst.rollout.engine import GenerateRequest, SamplingParams
    from verst.rollout.engines.sglang.client import SGLangClient
    from verst.rollout.engines.sglang.launcher import launch_router

    proc = None
    with summary.check("router/launch_and_workers") as info:
        proc = launch_router(urls, policy="round_robin", log_dir=logs / "router")
        client = SGLangClient(proc.url, router=True)
        workers = loop.run(client.workers())
        info["detail"] = f"GET /workers -> {workers}"
        assert sorted(workers) == sorted(urls)
    if proc is None:
        return
    try:
        with summary.check("router/generate_abort_refit") as info:
            outs = [
                loop.run(client.generate(GenerateRequest([1, 8, 9], SamplingParams(4)))) for _ in range(4)
            ]
            loop.run(client.abort())
            v = loop.run(client.update_weights_from_disk(str(model), 9))
            versions = [loop.run(SGLangClient(u).get_weight_version()) for u in urls]
            info["detail"] = f"{len(outs)} generations, refit version {v} on {versions}"
            assert versions == [9] * len(urls)
        loop.run(client.close())
    finally:
        proc.stop()


class _TrainStub:
    """The train surface WeightSync needs: the weights to send."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def state_dict_for_sync(self) -> dict:
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def save_hf(self, path: Any, state_dict: Any = None) -> None:
        raise AssertionError("not used")


class _RolloutStub:
    """The rollout surface WeightSync needs: an HTTP engine and a way to run its coroutines."""

    in_process_engine = False

    def __init__(self, engine: Any, loop: Loop) -> None:
        from verst.rollout.engine import engine_capabilities

        self.engine, self.loop = engine, loop
        self.engine_capabilities = engine_capabilities(engine)

    def submit(self, coro: Any) -> Any:
        return self.loop.submit(coro)
