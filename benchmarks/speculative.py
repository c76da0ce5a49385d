"""Speculative decoding in the embedded engine: tokens/s with and without, per task and batch size.

Why: a verify forward feeds `k + 1` tokens per row. Where a forward is overhead- or memory-bound
(few rows, a GPU) that costs little more than a plain step and accepted proposals are nearly free
tokens; where it is compute-bound (many rows on a CPU) it costs about `k + 1` plain steps. This
measures where speculation pays, and that the cost gate (`engine.speculative.gate = "auto"`)
keeps it from costing much where it does not.

Setup: the real embedded engine, one torch thread, greedy decoding (same prompts, same tokens
both ways: greedy speculation is token-identical), n-gram proposals (`num_tokens = --k`,
`min_ngram = 1`). Tasks (`--size tiny`): `reverse_digits` and `tool_math` (the examples' models
and eval prompts; tool_math's second turn: prompt, the model's tool call, the observation, which
the answer copies), `loop` (a random
tiny Llama whose greedy output falls into a loop) and `fail` (reverse_digits' model and prompts
with a proposer whose proposals always fail: the BOS id, never emitted). `--size 135m`: a random-init Llama at SmolLM2-135M's shape (hidden 576, 30
layers, 9 heads, 3 kv heads, intermediate 1536, vocab 49152), tasks `loop` and `fail`. Each
(task, batch) runs plain, spec with the gate (`auto`) and spec without it (`off`), interleaved for
`--repeats` rounds after a warm-up (a round runs all 64 prompts, or `--prompts`, `batch` requests at a time);
the table shows the median tokens/s of each, and each ratio is the median over rounds of the
round's ratio to the plain run beside it (paired: on a shared box the load drifts between
rounds more than it does within one; the ratio of the medians swung by ±15% run to run).

Run (a few minutes on 2 shared cores):
  uv run python benchmarks/speculative.py
  uv run python benchmarks/speculative.py --size 135m --batches 1 8

Last line: `spec_over_plain=<gate auto ÷ plain> acceptance=<y>` on `--headline` (task:batch;
default `tool_math:1`, the issue's copy task: the real second turn, each answer copying its
observation).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import torch

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded.engine import EmbeddedEngine

ROOT = Path(__file__).resolve().parents[1]


class WrongProposer:
    """Proposals that always fail: the BOS id, which the trained example model never emits."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, batch, rows, caps):
        return [[self.token] * c for c in caps], None

    def refit(self, named) -> None:
        pass


def _example(name: str) -> tuple[torch.nn.Module, list[list[int]]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ROOT / "examples" / name / "model" / "warm_start"
    tok = AutoTokenizer.from_pretrained(path)
    rows = [json.loads(line) for line in (ROOT / "examples" / name / "data" / "eval.jsonl").open()][:64]
    texts = [r["prompt"] for r in rows]
    if name == "tool_math":
        import sys

        sys.path.insert(0, str(ROOT / "examples" / "tool_math"))
        from make_example import tool_call, tool_response

        texts = [
            r["prompt"] + tool_call(*map(int, r["prompt"][:-1].split("*"))) + tool_response(int(r["label"]))
            for r in rows
        ]
    return AutoModelForCausalLM.from_pretrained(path).eval(), [tok(t)["input_ids"] for t in texts]


def _random(size: str) -> tuple[torch.nn.Module, list[list[int]]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if size == "135m":
        cfg = LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            intermediate_size=1536,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    else:
        cfg = LlamaConfig(
            vocab_size=64,
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=256,
            max_position_embeddings=512,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    g = torch.Generator().manual_seed(1)
    vocab = min(cfg.vocab_size, 1000)
    prompts = [[1, *torch.randint(4, vocab, (24,), generator=g).tolist()] for _ in range(64)]
    return LlamaForCausalLM(cfg).eval(), prompts


async def _timed(engine: EmbeddedEngine, waves: list[list[GenerateRequest]]) -> tuple[float, int]:
    """Wall time and tokens of the waves run one after another (each wave's requests at once)."""
    t0, n = time.perf_counter(), 0
    for reqs in waves:
        outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
        n += sum(len(o.output_ids) for o in outs)
    return time.perf_counter() - t0, n


async def measure(task: str, size: str, batch: int, args: argparse.Namespace) -> dict[str, float]:
    if task in ("reverse_digits", "tool_math") or (task == "fail" and size == "tiny"):
        model, prompts = _example("reverse_digits" if task == "fail" else task)
    else:
        model, prompts = _random(size)
    ignore = task == "loop" or (task == "fail" and size != "tiny")
    # every prompt once per measurement, `batch` at a time: at 1 row a measurement is 64 requests
    # in a row, not one (one request's few milliseconds made the ratios swing by ±30%)
    prompts = prompts[: args.prompts]
    total = max(batch, len(prompts))
    reqs = [
        GenerateRequest(prompts[i % len(prompts)], SamplingParams(args.tokens, 0.0, ignore_eos=ignore))
        for i in range(total)
    ]
    reqs = [reqs[i : i + batch] for i in range(0, total, batch)]
    engines = {}
    for mode in ("plain", "auto", "off"):
        spec = (
            None if mode == "plain" else {"type": "ngram", "num_tokens": args.k, "min_ngram": 1, "gate": mode}
        )
        engines[mode] = EmbeddedEngine(model, None, max_batch_size=batch, batch_wait_s=0.02, speculative=spec)
        if task == "fail" and spec is not None:
            engines[mode]._batch.speculative.proposer = WrongProposer(model.config.bos_token_id)
        if spec is not None:
            engines[mode]._batch.speculative.ragged = args.verify == "ragged"
    rates: dict[str, list[float]] = {m: [] for m in engines}
    try:
        for e in engines.values():
            await _timed(e, reqs)  # warm-up (and the gate's first timings)
        before = {m: dict(e.speculative_stats or {}) for m, e in engines.items()}
        for _ in range(args.repeats):
            for m, e in engines.items():
                dt, n = await _timed(e, reqs)
                rates[m].append(n / dt)
        out = {m: statistics.median(v) for m, v in rates.items()}
        for m in ("auto", "off"):  # paired: each round's ratio to the plain run next to it
            out[f"{m}_ratio"] = statistics.median(
                a / p for a, p in zip(rates[m], rates["plain"], strict=True)
            )
        for m in ("auto", "off"):
            s, b = engines[m].speculative_stats, before[m]
            d = {k: s[k] - b.get(k, 0.0) for k in s}
            out[f"{m}_acceptance"] = d["accepted"] / d["proposed"] if d["proposed"] else 0.0
            out[f"{m}_speculated"] = d["steps"] / max(1.0, d["steps"] + d["plain_steps"])
        return out
    finally:
        for e in engines.values():
            await e.close()


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=("tiny", "135m"), default="tiny")
    p.add_argument("--tasks", nargs="*", default=None)
    p.add_argument("--batches", nargs="*", type=int, default=[1, 8, 64])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=64, help="prompts per round (the first N; 64: all)")
    p.add_argument("--headline", default="tool_math:1")
    p.add_argument(
        "--verify",
        choices=("ragged", "padded"),
        default="ragged",
        help="the verify forward: each row's own tokens only (default) or every row padded to k + 1",
    )
    args = p.parse_args()
    torch.set_num_threads(1)
    tasks = args.tasks or (
        ["reverse_digits", "tool_math", "loop", "fail"] if args.size == "tiny" else ["loop", "fail"]
    )
    results = {}
    print(
        f"size={args.size} k={args.k} tokens={args.tokens} repeats={args.repeats} verify={args.verify} "
        "(median tokens/s; shared 2-core box)"
    )
    print(
        f"{'task':>15} {'rows':>4} {'plain':>9} {'auto':>9} {'off':>9} {'auto/plain':>10} {'off/plain':>9} {'acc':>5} {'spec%':>5}"
    )
    for task in tasks:
        for b in args.batches:
            r = await measure(task, args.size, b, args)
            results[f"{task}:{b}"] = r
            print(
                f"{task:>15} {b:>4} {r['plain']:>9.1f} {r['auto']:>9.1f} {r['off']:>9.1f} "
                f"{r['auto_ratio']:>10.2f} {r['off_ratio']:>9.2f} {r['off_acceptance']:>5.2f} "
                f"{100 * r['auto_speculated']:>5.0f}",
                flush=True,
            )
    h = results.get(args.headline) or next(iter(results.values()))
    worst = (
        min(r["auto_ratio"] for k, r in results.items() if k.startswith("fail:"))
        if any(k.startswith("fail:") for k in results)
        else float("nan")
    )
    print(f"fail_worst_auto_over_plain={worst:.2f}")
    print(f"spec_over_plain={h['auto_ratio']:.2f} acceptance={h['off_acceptance']:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
