"""The checks behind `scripts/gpu_check.sh`: what only a GPU (and a real SGLang server) can show.

Each subcommand appends `PASS name: detail` / `FAIL name: detail` lines to `--summary`; the shell
script runs them in order and prints the summary. Run through the shell script; by hand:

    uv run python scripts/gpu_checks.py model OUT/model            # tiny random model (no download)
    uv run python scripts/gpu_checks.py kernels --summary OUT/summary.txt
    uv run python scripts/gpu_checks.py sglang --model OUT/model --summary OUT/summary.txt
    uv run python scripts/gpu_checks.py sglang --server verst ...  # the same checks vs verst serve (CPU)

`model` runs on CPU. `kernels` needs CUDA. `sglang` needs CUDA and the sglang extra unless
`--server verst` (then it exercises the same client calls against `verst serve`, for a CPU
rehearsal; the tensor refit then sends CPU tensors by value instead of CUDA IPC handles).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


class Summary:
    """Appends one line per check to a file (and stdout)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.failed = 0

    def line(self, status: str, name: str, detail: str) -> None:
        text = f"{status} {name}: {detail}".replace("\n", " ")[:600]
        print(text, flush=True)
        with self.path.open("a") as f:
            f.write(text + "\n")
        self.failed += status == "FAIL"

    @contextlib.contextmanager
    def check(self, name: str) -> Iterator[dict[str, Any]]:
        """`with summary.check("x") as info: ...; info["detail"] = "..."` — an exception is a FAIL."""
        info: dict[str, Any] = {"detail": "ok"}
        start = time.perf_counter()
        try:
            yield info
        except Exception as exc:
            traceback.print_exc()
            self.line("FAIL", name, f"{type(exc).__name__}: {exc}")
            return
        status = info.get("status", "PASS")
        self.line(status, name, f"{info['detail']} ({time.perf_counter() - start:.1f}s)")


# ------------------------------------------------------------------------------------- model
def save_model(out: str | Path, *, dtype: str = "bfloat16") -> Path:
    """A tiny random Llama (head_dim 64, 2 layers) + char tokenizer, saved locally: no download."""
    import torch

    from verst.rollout.toy import make_tiny_checkpoint

    out = Path(out)
    make_tiny_checkpoint(
        out, seed=0, hidden_size=256, num_layers=2, num_heads=4, max_position_embeddings=8192
    )
    if dtype != "float32":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(out, dtype=getattr(torch, dtype))
        model.save_pretrained(out)
    return out


def scaled_copy(model: Path, out: Path, factor: float) -> Path:
    """`model` with the LM head scaled by `factor` (a different, recognisable policy)."""
    from transformers import AutoModelForCausalLM

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(model, out)
    m = AutoModelForCausalLM.from_pretrained(model)
    m.lm_head.weight.data.mul_(factor)
    m.save_pretrained(out)
    return out


# ----------------------------------------------------------------------------------- kernels
def _cuda_ms(fn: Callable[[], Any], repeat: int = 3) -> float:
    import torch

    fn()  # warm-up / compile
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def _ref_rows(x: Any, targets: Any, T: float, g_lp: Any, g_ent: Any | None) -> tuple[Any, Any, Any]:
    """float64 log-probs [n, M], entropy [n] and grad wrt x [n, V] for upstream g_lp/g_ent."""
    import torch

    z = x.double() / T
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    ent = -(p * logp).sum(-1)
    lp = logp.gather(-1, targets)
    grad = -p * g_lp.double().sum(-1, keepdim=True)
    grad.scatter_add_(-1, targets, g_lp.double())
    if g_ent is not None:
        grad -= g_ent.double()[:, None] * p * (logp + ent[:, None])
    return lp, ent, grad / T


def _max_err(a: Any, b: Any) -> float:
    return float((a.double() - b.double()).abs().max())


def kernels(summary: Summary) -> None:
    import torch
    import triton

    from verst.kernels import token_logprobs, topk_logprobs
    from verst.kernels._kernels import _row_backward_kernel
    from verst.kernels._launchers import _block_m, _block_v, _num_warps

    if not torch.cuda.is_available():
        summary.line("FAIL", "kernels", "no CUDA device")
        return
    dev = torch.device("cuda")
    torch.manual_seed(0)
    T_, V, temp = 32_768, 151_936, 0.8
    bw = 0.0
    with summary.check("kernels/copy_bandwidth") as info:
        x = torch.randn(T_, V, device=dev, dtype=torch.bfloat16).mul_(4)  # 9.3 GiB, > 2^31 elements
        copy = torch.empty_like(x)
        ms = _cuda_ms(lambda: copy.copy_(x))
        bw = 2 * x.numel() * x.element_size() / (ms / 1e3)
        copy.set_()  # free it
        info["detail"] = (
            f"{bw / 1e12:.2f} TB/s (read+write of {x.numel() * 2 / 2**30:.1f} GiB in {ms:.2f} ms)"
        )
    with summary.check("kernels/token_logprobs_T32768_V151936_bf16") as info:
        targets = torch.randint(0, V, (T_,), device=dev)
        xg = x.requires_grad_()
        fwd_ms = _cuda_ms(lambda: token_logprobs(x.detach(), targets, temp, return_entropy=True))
        lp, ent = token_logprobs(xg, targets, temp, return_entropy=True)
        g_lp, g_ent = torch.randn(T_, device=dev), torch.randn(T_, device=dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        end.record()
        torch.cuda.synchronize()
        bwd_ms = start.elapsed_time(end)
        worst_lp = worst_ent = worst_g = 0.0
        gmax = 0.0
        for s in range(0, T_, 1024):
            e = min(s + 1024, T_)
            rlp, rent, rg = _ref_rows(x[s:e].detach(), targets[s:e, None], temp, g_lp[s:e, None], g_ent[s:e])
            worst_lp = max(worst_lp, _max_err(lp[s:e], rlp[:, 0]))
            worst_ent = max(worst_ent, _max_err(ent[s:e], rent))
            err = (xg.grad[s:e].double() - rg).abs() - 2.0**-8 * rg.abs()  # bf16 output rounding
            worst_g = max(worst_g, float(err.max()))
            gmax = max(gmax, float(rg.abs().max()))
        bytes_fwd = x.numel() * x.element_size()
        ratio_f = fwd_ms / (bytes_fwd / bw * 1e3)
        ratio_b = bwd_ms / (2 * bytes_fwd / bw * 1e3)
        info["detail"] = (
            f"max|err| lp {worst_lp:.2e} ent {worst_ent:.2e} grad {worst_g:.2e} (of max {gmax:.2e}); "
            f"fwd {fwd_ms:.1f} ms = {ratio_f:.2f}x copy-bound, bwd {bwd_ms:.1f} ms = {ratio_b:.2f}x"
        )
        tol = 2e-5 + 16 * 1.2e-7 * float(x.abs().max()) / temp
        assert worst_lp <= tol and worst_ent <= tol, f"log-prob/entropy error above {tol:.2e}"
        assert worst_g <= 2e-5 * gmax + 1e-6, "gradient error above 2e-5 of its max"
        assert ratio_f < 4 and ratio_b < 4, "slower than 4x the copy-bandwidth bound"
        del lp, ent, xg
        x.grad = None
    del x
    torch.cuda.empty_cache()
    with summary.check("kernels/shifted_slice_read_in_place") as info:
        full = torch.randn(8, 4097, V, device=dev, dtype=torch.bfloat16)  # [B, T+1, V] 9.3 GiB
        tg = torch.randint(0, V, (8, 4096), device=dev)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        lp = token_logprobs(full[:, :-1], tg, 1.0)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        ref = torch.log_softmax(full[0, :-1].double(), -1).gather(-1, tg[0, :, None])[:, 0]
        info["detail"] = (
            f"extra peak {extra / 2**20:.0f} MiB (a copy would be {full.numel() * 2 / 2**30:.1f} GiB)"
        )
        assert extra < 256 * 2**20, "the slice was copied"
        assert _max_err(lp[0], ref) < 1e-3
        del full, lp
    torch.cuda.empty_cache()
    with summary.check("kernels/opd_backward_M16") as info:
        n, M = 4096, 16
        x = torch.randn(n, V, device=dev, dtype=torch.bfloat16).mul_(4).requires_grad_()
        ids = torch.randint(0, V, (n, M), device=dev)
        out = topk_logprobs(x, M, temp, token_ids=ids)
        g = torch.randn(n, M, device=dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        (out.token_logprobs * g).sum().backward()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end)
        rlp, _, rg = _ref_rows(x.detach()[:512], ids[:512], temp, g[:512], None)
        err_lp = _max_err(out.token_logprobs[:512], rlp)
        err_g = float(((x.grad[:512].double() - rg).abs() - 2.0**-8 * rg.abs()).max())
        # the compiled kernel's registers and spills (launched like TritonRowOps.backward)
        logits = x.detach()
        lse = torch.logsumexp(logits.float() / temp, -1)
        grad = torch.empty_like(logits)
        bv = _block_v(V, None)
        compiled = _row_backward_kernel[(n,)](
            logits, 0, logits.stride(0), n, ids, lse, lse, g, lse, grad, V, M, temp,
            BLOCK_V=bv, BLOCK_M=_block_m(M), WITH_ENTROPY=False, num_warps=_num_warps(bv),
        )  # fmt: skip
        regs, spills = getattr(compiled, "n_regs", -1), getattr(compiled, "n_spills", -1)
        bound = 2 * logits.numel() * 2 / bw * 1e3
        info["detail"] = (
            f"lp err {err_lp:.2e}, grad err {err_g:.2e}; bwd {ms:.1f} ms = {ms / bound:.2f}x copy-bound; "
            f"backward kernel {regs} registers, {spills} spills (triton {triton.__version__})"
        )
        if spills < 0:
            info["detail"] += " (this triton does not expose the spill count)"
        assert err_lp < 1e-3 and err_g < 2e-5 * float(rg.abs().max()) + 1e-6
        assert spills <= 0, "the backward kernel spills registers"


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
        extra_args=["--cuda-graph-max-bs", "8", "--log-level", "warning"],
        ready_timeout_s=420,
        log_dir=logs,
    )


def sglang(model: Path, summary: Summary, kind: str, logs: Path) -> None:
    import torch

    from verst.rollout.engine import GenerateRequest, SamplingParams
    from verst.rollout.engines.sglang.client import SGLangClient
    from verst.rollout.engines.sglang.launcher import LaunchedServers

    pre = f"{kind}"
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


def router(urls: list[str], summary: Summary, loop: Loop, logs: Path, model: Path) -> None:
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


def _decode_run(model: Any, ids: Any, att: Any, pos: Any, feed: Any) -> tuple[Any, float]:
    """Left-padded prefill + one decode step per row of `feed` ([steps, b] token ids, the same
    for both variants, so a flipped argmax cannot make them diverge) → (logits, s per step)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=att, position_ids=pos, past_key_values=cache)
        logits, mask, q = [out.logits[:, -1].float()], att, pos[:, -1:]
        sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for tok in feed:
            mask = torch.cat([mask, mask.new_ones((len(ids), 1))], dim=1)
            q = q + 1
            out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=q, past_key_values=cache)
            logits.append(out.logits[:, -1].float())
        sync()
    return torch.stack(logits), (time.perf_counter() - t0) / len(feed)


def grouped_attention(summary: Summary) -> None:
    """The embedded engine's grouped-query attention (`engines/embedded/attention.py`) on CUDA: logits of a
    left-padded prefill + 8 decode steps equal transformers' SDPA (fp32 and bf16), and the
    decode-step time of both (64 rows, SmolLM2-135M-like heads: 9 query / 3 KV, head_dim 64)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from verst.rollout.engines.embedded.attention import use_grouped_sdpa

    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 0.1)):
        with summary.check(f"engine/grouped_attention_{str(dtype).split('.')[-1]}") as info:
            cfg = LlamaConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=4, num_attention_heads=9,
                              num_key_value_heads=3, intermediate_size=1536, tie_word_embeddings=True)  # fmt: skip
            torch.manual_seed(0)
            model = LlamaForCausalLM(cfg).to("cuda", dtype).eval()
            b, p = 64, 256
            ids = torch.randint(0, 49152, (b, p), device="cuda")
            att = torch.ones_like(ids)
            for i in range(b):
                att[i, : (i % 8) * 24] = 0
            pos = (att.cumsum(1) - 1).clamp(min=0)
            feed = torch.randint(0, 49152, (8, b), device="cuda")
            _decode_run(model, ids, att, pos, feed)  # warm-up
            want, t_sdpa = _decode_run(model, ids, att, pos, feed)
            assert use_grouped_sdpa(model)
            _decode_run(model, ids, att, pos, feed)
            got, t_grouped = _decode_run(model, ids, att, pos, feed)
            err = float((got - want).abs().max())
            info["detail"] = (
                f"max |logit diff| {err:.2e} (tol {tol}); decode step sdpa {t_sdpa * 1e3:.2f} ms, grouped {t_grouped * 1e3:.2f} ms"
            )
            if not err <= tol:
                info["status"] = "FAIL"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model", help="save the tiny random model")
    m.add_argument("out")
    m.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    k = sub.add_parser("kernels", help="compiled Triton kernels vs float64, time vs copy bandwidth")
    k.add_argument("--summary", required=True)
    s = sub.add_parser("sglang", help="a real SGLang server (or verst serve) with the client")
    s.add_argument("--model", required=True)
    s.add_argument("--summary", required=True)
    s.add_argument("--server", default="sglang", choices=["sglang", "verst"])
    s.add_argument("--logs", default=None)
    args = p.parse_args(argv)
    if args.cmd == "model":
        print(json.dumps({"model": str(save_model(args.out, dtype=args.dtype))}))
        return 0
    summary = Summary(args.summary)
    if args.cmd == "kernels":
        kernels(summary)
        grouped_attention(summary)
    else:
        logs = Path(args.logs or Path(args.summary).parent / "logs")
        logs.mkdir(parents=True, exist_ok=True)
        sglang(Path(args.model), summary, args.server, logs)
    return 1 if summary.failed else 0


if __name__ == "__main__":
    sys.exit(main())
