"""Routing replay (R3) against the engine/trainer mismatch it exists to remove.

Why: on GPUs the inference engine runs an MoE in bf16 and the trainer in fp32; tiny numeric
differences flip a token's top-k experts, the two log-probs then come from different
sub-networks, and the importance ratio explodes. R3 makes the trainer use the experts the engine
recorded. This measures how much of the engine-vs-trainer log-prob mismatch that removes.

Setup: a tiny Qwen3-MoE made here (`verst.rollout.toy_moe`: 8 experts, top-2, hidden 128,
2 layers, random init, char tokenizer), reverse-digits prompts, a few GRPO steps: the embedded
engine generates (4 prompts × 8 samples, recording its experts), `TrainSide.train_step` trains in
float32 with `train.moe.routing_replay = "rollout"`, the weights go back to the engine. The
engine differs from the trainer in numerics the way a bf16 engine does:
- `--engine router_bf16` (default): the engine's router weights are held in bf16 (rounded on every
  refit), every other weight and op is the trainer's fp32 — the mismatch that is left is the one
  routing causes, which is what replay addresses;
- `--engine bf16`: the whole engine in bf16 — bf16 arithmetic everywhere adds a mismatch that no
  routing replay can remove (on this tiny model it dominates: expect a ratio near 1–2).
At every step, at the same weights and on the same samples, the trainer computes the engine
tokens' log-probs with R3 (the old log-probs the step trains with) and without
(`compare_without_replay`: its routers' own choice). Reported, averaged over the steps:
- `routing_agreement_without`: fraction of (token, layer) top-k sets the trainer's routers
  choose exactly as the engine did;
- mean |log-ratio| = mean |log π_trainer − log π_engine| over trained tokens, without and with R3;
- clip fraction: tokens whose ratio π_trainer/π_engine leaves [0.8, 1.2], without and with R3.

Run (about a minute on 2 quiet cores):
  uv run python benchmarks/moe_replay.py
  uv run python benchmarks/moe_replay.py --steps 5 --layers 4

  uv run python benchmarks/moe_replay.py --seeds 5 --no-study   # the spread over 5 seeds

`--seeds N` repeats the run for seeds 0..N-1 (the seed makes the random-init checkpoint and the
sampling seeds) and prints each seed's figures and their min / median / max: under bf16 routers
the reduction depends strongly on the seed (how many top-k sets flip, and how much each flip
moves the log-probs), so report the spread, not one figure.

Last line: `r3_mismatch_reduction=<median without/with> routing_agreement_without=<median>`, plus
with `--seeds` the min and max of each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "reverse_digits" / "data" / "train.jsonl"


def _groups(engine, tok, prompts: list[str], n: int, step: int, seed: int = 0) -> list:
    """One rollout: n samples per prompt from the engine, with recorded routing, scored."""
    import asyncio

    from verst.rollout.engine import GenerateRequest, SamplingParams
    from verst.rollout.sample import Sample, Status

    async def one(g: int, prompt: str) -> list:
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        label = prompt[:-1][::-1]
        reqs = [
            GenerateRequest(
                ids,
                SamplingParams(
                    max_new_tokens=10, temperature=1.0, sampling_seed=10**6 * seed + 1000 * step + 10 * g + j
                ),
                return_routed_experts=True,
            )
            for j in range(n)
        ]
        outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
        group = []
        for j, o in enumerate(outs):
            text = tok.decode(o.output_ids, skip_special_tokens=True)
            reward = sum(a == b for a, b in zip(text, label, strict=False)) / len(label)
            group.append(
                Sample(
                    prompt=prompt,
                    tokens=ids + o.output_ids,
                    response_length=len(o.output_ids),
                    rollout_logprobs=o.output_logprobs,
                    routed_experts=o.routed_experts,
                    reward=reward,
                    status=Status.COMPLETED if o.finish_reason == "stop" else Status.TRUNCATED,
                    group_index=g,
                    sample_index=n * g + j,
                )
            )
        return group

    async def all_groups() -> list:
        return list(await asyncio.gather(*(one(g, p) for g, p in enumerate(prompts))))

    return engine_loop.run_until_complete(all_groups())


engine_loop = None


def _engine_weights(state: dict, engine_dtype: str) -> dict:
    """What the engine holds of the trainer's weights: its router weights rounded to bf16
    ('router_bf16'), or every weight in bf16 ('bf16')."""
    import torch

    out = {}
    for name, t in state.items():
        if engine_dtype == "bf16":
            out[name] = t.to(torch.bfloat16)
        elif name.endswith("mlp.gate.weight"):
            out[name] = t.to(torch.bfloat16).float()
        else:
            out[name] = t
    return out


def run(steps: int, layers: int, threads: int, engine_dtype: str, seed: int = 0) -> dict[str, float]:
    import asyncio
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verst.rollout.engines.embedded import EmbeddedEngine
    from verst.rollout.toy_moe import make_tiny_moe_checkpoint
    from verst.trainer.algorithms import AlgorithmConfig
    from verst.trainer.config import TrainConfig
    from verst.trainer.train.batch import build_train_batch
    from verst.trainer.train.moe import MoeSection
    from verst.trainer.train.side import TrainSide

    global engine_loop
    torch.set_num_threads(threads)
    rows = [json.loads(line)["prompt"] for line in DATA.read_text().splitlines()[: 4 * steps]]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_moe_checkpoint(Path(tmp) / "moe", family="qwen3_moe", num_layers=layers, seed=seed)
        tok = AutoTokenizer.from_pretrained(path)
        dtype = torch.bfloat16 if engine_dtype == "bf16" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        engine_loop = asyncio.new_event_loop()
        asyncio.set_event_loop(engine_loop)
        engine = EmbeddedEngine(model, tok, batch_wait_s=0.02)
        cfg = TrainConfig(
            model_path=str(path),
            lr=1e-3,
            micro_batch_size=32,
            num_threads=threads,
            moe=MoeSection(routing_replay="rollout", compare_without_replay=True),
        )
        side = TrainSide(
            cfg,
            AlgorithmConfig(),
            model_path=str(path),
            total_steps=steps,
            max_response_len=10,
            temperature=1.0,
            env={},
        )
        engine_loop.run_until_complete(
            engine.update_weights_from_tensors(_engine_weights(side.state_dict_for_sync(), engine_dtype))
        )
        started = time.perf_counter()
        metrics = []
        for step in range(steps):
            groups = _groups(engine, tok, rows[4 * step : 4 * step + 4], 8, step, seed)
            metrics.append(side.train_step(build_train_batch(groups)))
            state = _engine_weights(side.state_dict_for_sync(), engine_dtype)
            engine_loop.run_until_complete(engine.update_weights_from_tensors(state))
        seconds = time.perf_counter() - started
        engine_loop.run_until_complete(engine.close())
        side.close()

    def mean(key: str) -> float:
        return statistics.fmean(m[key] for m in metrics)

    return {
        "steps": float(len(metrics)),
        "seconds": seconds,
        "agreement": mean("train/moe/routing_agreement"),
        "replay_agreement": mean("train/moe/replay_agreement"),
        "without": mean("train/moe/logprob_mismatch_no_replay"),
        "with": mean("train/logprob_mismatch"),
        "clip_without": mean("train/moe/logprob_ratio_clip_frac_no_replay"),
        "clip_with": mean("train/logprob_ratio_clip_frac"),
    }


# ------------------------------------------------------------------- where the bf16 mismatch is

PARTS = {
    # name: (dtype of everything but the MoE blocks, dtype of the MoE blocks, router weights rounded)
    "fp32": ("float32", "float32", False),
    "router_bf16": ("float32", "float32", True),
    "moe_bf16": ("float32", "bfloat16", False),
    "dense_bf16": ("bfloat16", "float32", False),
    "bf16": ("bfloat16", "bfloat16", False),
}
"""Engine variants of the forward study: which part runs in bf16. 'dense' = embeddings,
attention, norms and the LM head; 'moe' = each layer's MoE block (router + experts)."""


def _engine_variant(path: Path, part: str):
    """The tiny MoE as an engine holding `part` in bf16 (`PARTS`): MoE blocks in another dtype
    than the rest get their input cast in and their output cast back."""
    import torch
    from transformers import AutoModelForCausalLM

    rest, moe, round_router = (getattr(torch, d) if isinstance(d, str) else d for d in PARTS[part])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=rest).eval()
    for layer in model.model.layers:
        block = layer.mlp.to(moe)
        if round_router:
            with torch.no_grad():
                block.gate.weight.copy_(block.gate.weight.to(torch.bfloat16).float())
        if moe != rest:
            block.register_forward_pre_hook(lambda mod, args, d=moe: (args[0].to(d), *args[1:]))
            block.register_forward_hook(lambda mod, args, out, d=rest: out.to(d))
    return model


def _token_logprobs(model, ids, mask, hooks, replay=None):
    """Teacher-forced log-probs `[B, T-1]` (float32) of `ids [B, T]` and the experts the routers
    used (`[B*T, layers, k]`), replaying `replay` when given."""
    import torch

    hooks.replay, hooks.record = replay, True
    hooks.clear()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    return lp, hooks.chosen()


def forward_study(path: Path, prompts: list[str], threads: int) -> dict[str, dict[str, float]]:
    """Per engine variant: routing agreement with the fp32 trainer, and the mean |log-ratio| over
    sampled response tokens without and with replaying the variant's experts (no training)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verst.rollout.moe import RouterHooks

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(path)
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    enc = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(map(len, enc))
    left = torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in enc])
    attn = (left != tok.pad_token_id).long()
    torch.manual_seed(0)
    with torch.no_grad():
        ids = trainer.generate(
            input_ids=left,
            attention_mask=attn,
            max_new_tokens=10,
            do_sample=True,
            pad_token_id=tok.pad_token_id,
        )
    mask = torch.cat([attn, torch.ones(ids.shape[0], ids.shape[1] - width, dtype=torch.long)], 1)
    response = torch.zeros_like(ids[:, 1:], dtype=torch.bool)
    response[:, width - 1 :] = True
    trainer_hooks = RouterHooks(trainer)
    out = {}
    for part in PARTS:
        engine = _engine_variant(path, part)
        hooks = RouterHooks(engine)
        lp_engine, chosen = _token_logprobs(engine, ids, mask, hooks)
        lp_free, free = _token_logprobs(trainer, ids, mask, trainer_hooks)
        lp_r3, _ = _token_logprobs(trainer, ids, mask, trainer_hooks, replay=chosen)
        real = mask.reshape(-1).bool()
        same = (free.sort(-1).values == chosen.sort(-1).values).all(-1)[real]
        out[part] = {
            "agreement": float(same.float().mean()),
            "without": float((lp_free - lp_engine).abs()[response].mean()),
            "with": float((lp_r3 - lp_engine).abs()[response].mean()),
        }
        hooks.close()
    trainer_hooks.close()
    return out


def _print_study(layers: int, threads: int) -> None:
    """The forward study's table (a fresh tiny MoE of the same shape, seed 0)."""
    import json

    from verst.rollout.toy_moe import make_tiny_moe_checkpoint

    prompts = [json.loads(line)["prompt"] for line in DATA.read_text().splitlines()[:32]]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_moe_checkpoint(Path(tmp) / "moe", family="qwen3_moe", num_layers=layers, seed=0)
        study = forward_study(path, prompts, threads)
    print("forward study (32 sampled sequences, no training): engine part in bf16 vs the fp32 trainer")
    print("engine         agreement  |log-ratio| free   with replay   free/replay")
    for part, m in study.items():
        ratio = f"{m['without'] / m['with']:.2f}" if m["with"] > 0 else "n/a"
        print(f"{part:<14} {m['agreement']:.4f}     {m['without']:.3e}        {m['with']:.3e}     {ratio}")


def _spread(values: list[float], fmt: str) -> str:
    return f"min {min(values):{fmt}} / median {statistics.median(values):{fmt}} / max {max(values):{fmt}}"


def _print_run(r: dict[str, float], engine: str, seed: int) -> None:
    print(
        f"seed {seed}: {int(r['steps'])} GRPO steps in {r['seconds']:.0f}s (engine {engine}, trainer fp32, tiny Qwen3-MoE)"
    )
    print(
        f"  routing agreement engine vs trainer without replay: {r['agreement']:.4f} (with R3: {r['replay_agreement']:.4f})"
    )
    print(
        f"  mean |log-ratio| without R3: {r['without']:.6f}   with R3: {r['with']:.6f}"
        f"   reduction {r['without'] / max(r['with'], 1e-12):.2f}x"
    )
    print(
        f"  clip fraction (ratio outside [0.8, 1.2]) without R3: {r['clip_without']:.4f}   with R3: {r['clip_with']:.4f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the tiny MoE")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument(
        "--engine",
        choices=("router_bf16", "bf16"),
        default="router_bf16",
        help="router_bf16: the engine's router weights in bf16, the rest fp32 (isolates routing); "
        "bf16: the whole engine in bf16",
    )
    parser.add_argument(
        "--no-study",
        dest="study",
        action="store_false",
        help="skip the forward study (which part of the engine in bf16 causes how much mismatch)",
    )
    parser.add_argument("--seeds", type=int, default=1, help="repeat for seeds 0..N-1 and report the spread")
    args = parser.parse_args()
    results = [run(args.steps, args.layers, args.threads, args.engine, seed) for seed in range(args.seeds)]
    for seed, r in enumerate(results):
        _print_run(r, args.engine, seed)
    if args.study:
        _print_study(args.layers, args.threads)
    reductions = [r["without"] / max(r["with"], 1e-12) for r in results]
    agreements = [r["agreement"] for r in results]
    tail = ""
    if len(results) > 1:
        print(
            f"over {len(results)} seeds: reduction "
            + _spread(reductions, ".2f")
            + ", agreement "
            + _spread(agreements, ".4f")
        )
        tail = (
            f" r3_mismatch_reduction_min={min(reductions):.2f} r3_mismatch_reduction_max={max(reductions):.2f}"
            f" routing_agreement_without_min={min(agreements):.4f}"
        )
    print(
        f"r3_mismatch_reduction={statistics.median(reductions):.2f} "
        f"routing_agreement_without={statistics.median(agreements):.4f}{tail}"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
