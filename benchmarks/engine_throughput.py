"""Embedded engine throughput vs plain `model.generate`: same model, same requests, same run.

Why: the embedded engine decodes with its own batched loop (continuous batching on transformers'
`DynamicCache`, prefix sharing of identical prompts, per-request sampling/stop/abort); it must
beat the baseline every user already has, transformers' `generate` on the same batch.

The workload is a GRPO rollout: `--requests` rows = `--requests / --group-size` prompts of
mixed lengths (`--prompt-len MIN MAX`), each sampled `--group-size` times, at temperature 1
with no truncation. One run measures three cases, each with its own ratio:

- `equal_distinct` (the headline): every row its own prompt and exactly `--mean-new-tokens`
  new tokens: no prefix to share and no dead rows for `generate` to carry, so the ratio is the
  engine's decode loop against `generate`'s;
- `shared_prompt`: groups of `--group-size` rows share a prompt, equal lengths (what prefix
  sharing adds);
- `drawn`: groups sharing a prompt, lengths drawn as below (what continuous batching adds:
  `generate` keeps computing finished rows until the batch's longest is done).

`--case` runs one of them; `--lengths` picks the lengths of a single case:

- `--lengths equal`: every row `--mean-new-tokens` tokens, both sides;
- `--lengths drawn`: each row's length is drawn once (geometric, mean
  `--mean-new-tokens`, capped at `--max-new-tokens`) and both sides stop that row there — the
  engine through the row's `max_new_tokens`, `generate` through a per-row stopping criterion
  (exactly how it treats EOS: the row is done, the batch runs until its last row is). Both
  sides produce the same useful tokens.
- `--lengths natural`: both sides stop a row when it samples EOS (the tiny model's EOS is one
  token of ~64, so lengths spread naturally); a big random vocabulary almost never samples it.

Only useful tokens count (up to and including a row's last token), on both sides. The engine
receives the rows as that many concurrent `generate` calls; `generate` gets them as one
left-padded batch. After a warm-up, `--repeats` timed pairs run interleaved (so machine load
hits both alike); the ratio is the median of the per-pair wall-clock ratios. Tokens per CPU
second (process time, all threads) are printed too (steadier on a loaded machine).

The model is the tiny test checkpoint unless `--vocab/--hidden/--layers` give a random Llama
of that shape (e.g. `--vocab 49152 --hidden 384 --layers 8`, ~30M parameters, SmolLM2's
vocabulary size). `--profile` prints a cProfile of the engine's worker thread over `--repeats`
runs of one case (the headline's unless `--case`) instead of timing.

Run:  uv run python benchmarks/engine_throughput.py [--requests 64 --group-size 8 --threads 1]
Last line: `engine_vs_hf_generate=<equal_distinct> shared_prompt=<r> drawn=<r>`, each the engine's
useful tok/s over `generate`'s (target for the headline: >= 1.3).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import tempfile
import time

import torch

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.toy import build_tiny_llama, make_tiny_checkpoint


def make_prompts(n: int, group: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    """`n` rows: `n / group` distinct prompts (lengths in [lo, hi]), each repeated `group` times."""
    g = torch.Generator().manual_seed(0)
    distinct = []
    for _ in range(-(-n // group)):
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        distinct.append([1, *torch.randint(4, vocab, (length - 1,), generator=g).tolist()])
    return [distinct[i // group] for i in range(n)]


def draw_lengths(n: int, mean: float, cap: int, seed: int) -> list[int]:
    """Geometric response lengths (mean `mean`), capped at `cap`."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    p = 1.0 / max(mean, 1.0)
    lengths = (torch.log1p(-u) / torch.log1p(torch.tensor(-p, dtype=torch.float64))).ceil()
    return [int(min(cap, max(1, x))) for x in lengths.tolist()]


class _RowLengths:
    """A `generate` stopping criterion: row i is done after `lengths[i]` new tokens (like EOS)."""

    def __init__(self, width: int, lengths: list[int]) -> None:
        self.width = width
        self.lengths = torch.tensor(lengths)  # [batch]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return (input_ids.shape[1] - self.width) >= self.lengths  # [batch] bool


def useful(row: list[int], eos: int | None, length: int | None) -> int:
    """New tokens up to and including the row's last real one (EOS or its drawn length)."""
    if length is not None:
        return min(length, len(row))
    return row.index(eos) + 1 if eos is not None and eos in row else len(row)


def run_hf(model, prompts, lengths, max_new: int, pad_id: int, eos: int | None) -> tuple[int, float, float]:
    from transformers import StoppingCriteriaList

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id)  # [batch, width]
    mask = torch.zeros_like(ids)  # [batch, width]
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    extra = {}
    if lengths is not None:  # rows end at their drawn length, EOS plays no part
        extra = {
            "stopping_criteria": StoppingCriteriaList([_RowLengths(width, lengths)]),
            "eos_token_id": None,
        }
    else:
        extra = {"eos_token_id": eos}
    start, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max(lengths) if lengths is not None else max_new,
            pad_token_id=pad_id,
            **extra,
        )
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    new = out[:, width:].tolist()
    n = sum(useful(r, eos, None if lengths is None else lengths[i]) for i, r in enumerate(new))
    return n, elapsed, cpu


async def run_engine(engine: EmbeddedEngine, prompts, lengths, max_new: int) -> tuple[int, float, float]:
    if lengths is None:
        params = [SamplingParams(max_new_tokens=max_new, temperature=1.0) for _ in prompts]
    else:
        params = [SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True) for n in lengths]
    start, cpu = time.perf_counter(), time.process_time()
    outs = await asyncio.gather(
        *(engine.generate(GenerateRequest(p, s)) for p, s in zip(prompts, params, strict=True))
    )
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return sum(len(o.output_ids) for o in outs), elapsed, cpu


class ProfiledEngine(EmbeddedEngine):
    """The engine with its worker thread (where every forward runs) under cProfile."""

    def _run(self) -> None:
        self.profile = cProfile.Profile()
        self.profile.enable()
        try:
            super()._run()
        finally:
            self.profile.disable()


def build_engine(args, tmp: str) -> tuple[EmbeddedEngine, int, int | None]:
    """(engine, pad id, EOS id) for the tiny checkpoint or a random Llama of the asked shape."""
    cls = ProfiledEngine if args.profile else EmbeddedEngine
    if args.vocab is None and args.hidden is None and args.layers is None:
        path = make_tiny_checkpoint(f"{tmp}/model")
        engine = cls.from_pretrained(path, max_batch_size=args.requests)
        return engine, engine.tokenizer.pad_token_id, engine.tokenizer.eos_token_id
    model = build_tiny_llama(
        args.vocab or 64,
        hidden_size=args.hidden or 128,
        num_layers=args.layers or 4,
        num_heads=max(1, (args.hidden or 128) // 64),
        max_position_embeddings=args.prompt_len[1] + args.max_new_tokens + 8,
    )
    return cls(model, None, max_batch_size=args.requests), 0, 2


CASES = {  # name: (rows per prompt, lengths)
    "equal_distinct": (1, "equal"),
    "shared_prompt": (None, "equal"),  # None: --group-size
    "drawn": (None, "drawn"),
}


def case_lengths(args, mode: str, seed: int) -> list[int] | None:
    """Every row's new tokens in one run of a case (None: `natural`, each row stops at EOS)."""
    if mode == "natural":
        return None
    if mode == "equal":
        return [int(args.mean_new_tokens)] * args.requests
    return draw_lengths(args.requests, args.mean_new_tokens, args.max_new_tokens, seed)


async def measure(engine, args, group_size: int, lengths_mode: str, pad_id: int, eos: int | None) -> float:
    """Interleaved timed pairs of one case; prints its lines and returns the median ratio."""
    model = engine.model
    prompts = make_prompts(args.requests, group_size, *args.prompt_len, engine.vocab_size)
    hf, eng, hf_cpu, eng_cpu, toks = [], [], [], [], []
    for rep in range(args.repeats):  # interleaved, so machine load hits both alike
        lengths = case_lengths(args, lengths_mode, rep)
        n, t, c = run_hf(model, prompts, lengths, args.max_new_tokens, pad_id, eos)
        hf.append(n / t)
        hf_cpu.append(n / c)
        m, t, c = await run_engine(engine, prompts, lengths, args.max_new_tokens)
        eng.append(m / t)
        eng_cpu.append(m / c)
        toks.append((n, m))
    ratios = sorted(e / h for e, h in zip(eng, hf, strict=True))
    print(f"-- group_size={group_size} lengths={lengths_mode}")
    print(f"useful tokens per run (generate, engine): {', '.join(f'{a}/{b}' for a, b in toks)}")
    print(f"hf_generate_tok_s={statistics.median(hf):.0f} median (runs: {', '.join(f'{x:.0f}' for x in hf)})")
    print(
        f"embedded_engine_tok_s={statistics.median(eng):.0f} median (runs: {', '.join(f'{x:.0f}' for x in eng)})"
    )
    print(
        f"per CPU second: hf_generate={statistics.median(hf_cpu):.0f} embedded_engine={statistics.median(eng_cpu):.0f}"
    )
    print(f"per_pair_ratios={', '.join(f'{r:.2f}' for r in ratios)}", flush=True)
    return statistics.median(ratios)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64, help="rows in the batch")
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt (1 = all distinct)")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(16, 64), metavar=("MIN", "MAX"))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--case", choices=sorted(CASES), help="one case only (default: all three)")
    ap.add_argument(
        "--lengths", choices=("equal", "drawn", "natural"), help="with --case: override its lengths"
    )
    ap.add_argument("--mean-new-tokens", type=float, default=48.0, help="mean of the drawn lengths")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--profile", action="store_true", help="cProfile one engine run, no timing")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        engine, pad_id, eos = build_engine(args, tmp)
        model = engine.model
        params = sum(p.numel() for p in model.parameters())
        warm = make_prompts(8, 1, *args.prompt_len, engine.vocab_size)
        run_hf(model, warm, [4] * 8, 4, pad_id, eos)  # warm-up
        await run_engine(engine, warm, [4] * 8, 4)
        print(
            f"requests={args.requests} group_size={args.group_size} prompt_len={args.prompt_len[0]}-{args.prompt_len[1]} "
            f"max_new_tokens={args.max_new_tokens} mean_new_tokens={args.mean_new_tokens} threads={args.threads} "
            f"params={params / 1e6:.2f}M vocab={engine.vocab_size}"
        )
        if args.profile:  # the worker thread over one case (the headline's unless --case), warm-up included
            group, mode = CASES[args.case or "equal_distinct"]
            mode = args.lengths or mode
            prompts = make_prompts(
                args.requests, group or args.group_size, *args.prompt_len, engine.vocab_size
            )
            for rep in range(args.repeats):
                lengths = case_lengths(args, mode, rep)
                await run_engine(engine, prompts, lengths, args.max_new_tokens)
            await engine.close()
            pstats.Stats(engine.profile).sort_stats("tottime").print_stats(30)
            return
        names = [args.case] if args.case else list(CASES)
        ratios = {}
        for name in names:
            group, lengths_mode = CASES[name]
            lengths_mode = args.lengths if args.case and args.lengths else lengths_mode
            ratios[name] = await measure(engine, args, group or args.group_size, lengths_mode, pad_id, eos)
            print(f"{name}: engine over generate {ratios[name]:.2f}", flush=True)
        print(f"engine prefill: {getattr(engine, 'prefill_stats', None)}")
        await engine.close()
    head = ratios.get("equal_distinct", next(iter(ratios.values())))
    rest = " ".join(f"{k}={v:.2f}" for k, v in ratios.items() if k != "equal_distinct")
    print(f"engine_vs_hf_generate={head:.2f} {rest}".rstrip())


if __name__ == "__main__":
    asyncio.run(main())
