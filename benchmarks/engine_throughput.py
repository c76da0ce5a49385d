"""Embedded engine throughput vs plain `model.generate`, same tiny model, same requests, same run.

Why: the embedded engine decodes with its own batched loop (continuous batching on transformers'
`DynamicCache`, per-request sampling/stop/abort); it must not be slower than the baseline every
user already has, transformers' `generate` on the same batch. Both sample at temperature 1 with
no truncation, ignore EOS, and produce `--max-new-tokens` for each of `--requests` prompts of
mixed lengths (the engine receives them as that many concurrent `generate` calls; `generate`
gets them as one left-padded batch). After a warm-up, `--repeats` timed pairs run interleaved
(so machine load hits both alike); the ratio is the median of the per-pair wall-clock ratios.
Tokens per CPU second (process time, all threads) are printed too: on a shared, loaded
machine they are the steadier comparison.

Run:  uv run python benchmarks/engine_throughput.py [--requests 64 --max-new-tokens 64 --threads 1]
Last line: engine_vs_hf_generate=<engine tok/s / generate tok/s>  (target >= 1.0)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import torch

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded import EmbeddedEngine
from verst.rollout.toy import make_tiny_checkpoint


def make_prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [[1, *torch.randint(4, vocab, (8 + i % 17,), generator=g).tolist()] for i in range(n)]


def run_hf(model, prompts: list[list[int]], max_new: int, pad_id: int) -> tuple[int, float, float]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id)  # [batch, width]
    mask = torch.zeros_like(ids)  # [batch, width]
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    start, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            pad_token_id=pad_id,
        )
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return (out.shape[1] - width) * len(prompts), elapsed, cpu


async def run_engine(
    engine: EmbeddedEngine, prompts: list[list[int]], max_new: int
) -> tuple[int, float, float]:
    params = SamplingParams(max_new_tokens=max_new, temperature=1.0, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    outs = await asyncio.gather(*(engine.generate(GenerateRequest(p, params)) for p in prompts))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return sum(len(o.output_ids) for o in outs), elapsed, cpu


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(f"{tmp}/model")
        engine = EmbeddedEngine.from_pretrained(path, max_batch_size=args.requests)
        model, tok = engine.model, engine.tokenizer
        prompts = make_prompts(args.requests, len(tok))
        run_hf(model, prompts[:8], 4, tok.pad_token_id)  # warm-up
        await run_engine(engine, prompts[:8], 4)
        hf, eng, hf_cpu, eng_cpu = [], [], [], []
        for _ in range(args.repeats):  # interleaved, so machine load hits both alike
            n, t, c = run_hf(model, prompts, args.max_new_tokens, tok.pad_token_id)
            hf.append(n / t)
            hf_cpu.append(n / c)
            n, t, c = await run_engine(engine, prompts, args.max_new_tokens)
            eng.append(n / t)
            eng_cpu.append(n / c)
        await engine.close()
    print(f"requests={args.requests} max_new_tokens={args.max_new_tokens} threads={args.threads}")
    print(f"hf_generate_tok_s={statistics.median(hf):.0f} median (runs: {', '.join(f'{x:.0f}' for x in hf)})")
    print(
        f"embedded_engine_tok_s={statistics.median(eng):.0f} median (runs: {', '.join(f'{x:.0f}' for x in eng)})"
    )
    print(
        f"per CPU second: hf_generate={statistics.median(hf_cpu):.0f} embedded_engine={statistics.median(eng_cpu):.0f}"
    )
    ratios = sorted(e / h for e, h in zip(eng, hf, strict=True))
    print(f"per_pair_ratios={', '.join(f'{r:.2f}' for r in ratios)}")
    print(f"engine_vs_hf_generate={statistics.median(ratios):.2f}")


if __name__ == "__main__":
    asyncio.run(main())
