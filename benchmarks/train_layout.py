"""Micro-batch layouts at a GRPO size: forward + backward time and peak memory, padded vs shared prompt.

Why: in GRPO the n samples of a group share their prompt, and the padded layout computes that
prompt n times, forward and backward. `train.layout = "shared_prompt"` (verst.trainer.train.layout)
puts a group in one row `[prompt, resp_1, ..., resp_n]` with a 4D mask, so the prompt is
computed once. This measures what that buys on the train step's log-prob forward/backward, and
what `auto` (which may also split a group into rows of 2, 4, ... responses) picks and buys,
against the padded layout in the same run.

Setup: a random-init Llama built from a config (SmolLM2's vocabulary 49,152 and tied
embeddings, a scaled-down SmolLM2 shape: hidden 384, 8 layers, 6 heads / 2 KV heads, MLP 1024:
~32M parameters), float32, SDPA, `--threads` torch threads. A batch of `--groups` prompts × `--n`
samples, prompts of 64–256 tokens (evenly spread), responses of `--response` tokens; one
micro-batch per group (micro_batch_size = n, as `micro_batches` lays them out). A step is the
forward + backward of `Σ log-probs` (+ entropy as a metric, as the train step computes it) over
every micro-batch, through `PolicyLogprobs` (chunked LM head). Layouts are timed interleaved per
micro-batch, back to back (`--repeats` rounds after one warm-up round; median step time); the
peak memory is the highest running sum of the torch profiler's allocation events during one
micro-batch (the biggest group), above what was alive before it. `--entropy` also times the shared layout
without the entropy output (what the entropy metric costs).

Run (padded ≈ 15 s per step at the default size on 2 quiet cores; ~3 min in all):
  uv run python benchmarks/train_layout.py
  uv run python benchmarks/train_layout.py --groups 2 --repeats 1     # a quick check

The last line is `shared_over_padded=<padded / shared wall time> shared_over_padded_cpu=<the same in
CPU time> shared_peak_mem_ratio=<padded / shared> auto=<the layout auto picks most>
auto_over_padded=<padded / auto wall time>` (+ `entropy_cost=<with / without>` with `--entropy`).
CPU time is printed because a loaded box shifts wall time by several times between rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build_model(args: argparse.Namespace):
    from transformers import LlamaConfig, LlamaForCausalLM

    from verst.trainer.train.logprobs import PolicyLogprobs

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return PolicyLogprobs(LlamaForCausalLM(cfg).float(), backend="auto", chunk_size=256)


def build_batch(args: argparse.Namespace) -> list[tuple[list[list[int]], list[int]]]:
    """Micro-batches (tokens, response lengths), one group each."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for g in range(args.groups):
        p = 64 + (192 * g) // max(1, args.groups - 1)
        prompt = torch.randint(4, 49152, (p,), generator=gen).tolist()
        seqs = [
            prompt + torch.randint(4, 49152, (args.response,), generator=gen).tolist() for _ in range(args.n)
        ]
        out.append((seqs, [args.response] * args.n))
    return out


def layout_label(layout) -> str:
    """'padded', 'shared_prompt', or 'shared_prompt/4' (at most 4 responses per row)."""
    per_row = getattr(layout, "per_row", None)
    return layout.name if per_row is None else f"{layout.name}/{per_row}"


def micro_step(model, tokens, resp, layout: str, chooser, *, entropy: bool = True) -> tuple[float, float]:
    """Wall and CPU seconds of one micro-batch's forward + backward in `layout` ('auto' = chooser)."""
    from verst.trainer.train.logprobs import pack_sequences

    t0, c0 = time.perf_counter(), time.process_time()
    inputs = (
        chooser.lay_out(tokens, resp) if layout == "auto" else pack_sequences(tokens, resp, layout=layout)
    )
    lp, ent = model(inputs, return_entropy=entropy)
    if ent is not None:
        float(ent.detach().mean())  # the metric
    lp.sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, time.process_time() - c0


def peak_bytes(model, tokens, resp, layout: str) -> int:
    """Highest running sum of allocations - frees during one micro-batch's forward + backward."""
    from torch.profiler import ProfilerActivity, profile

    from verst.trainer.train.logprobs import pack_sequences

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        lp, ent = model(pack_sequences(tokens, resp, layout=layout), return_entropy=True)
        lp.sum().backward()
        del lp, ent
    model.zero_grad(set_to_none=True)
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=8, help="prompts (one micro-batch each)")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--response", type=int, default=128, help="response tokens per sample")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (after one warm-up round)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument(
        "--layouts",
        default="padded,shared_prompt,auto",
        help="comma-separated layouts to time ('auto' = chooser)",
    )
    p.add_argument("--entropy", action="store_true", help="also time shared_prompt without entropy")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from verst.trainer.train.layout_choice import LayoutChooser

    model = build_model(args)
    batch = build_batch(args)
    params = sum(p.numel() for p in model.parameters())
    chooser = LayoutChooser.build("auto", config=model.policy.config, attn="sdpa")
    picks = [layout_label(chooser.pick(t, r)) for t, r in batch]
    auto = max(set(picks), key=picks.count)
    layouts = args.layouts.split(",")
    variants = [(name, True) for name in layouts]
    if args.entropy:
        variants.append(("shared_prompt", False))
    # interleaved per micro-batch (variants back to back), so load drift hits all alike
    wall: dict[tuple[str, bool], list[float]] = {v: [] for v in variants}
    cpu: dict[tuple[str, bool], list[float]] = {v: [] for v in variants}
    for r in range(args.repeats + 1):
        step_wall = dict.fromkeys(variants, 0.0)
        step_cpu = dict.fromkeys(variants, 0.0)
        for tokens, resp in batch:
            for name, ent in variants:
                w, c = micro_step(model, tokens, resp, name, chooser, entropy=ent)
                step_wall[(name, ent)] += w
                step_cpu[(name, ent)] += c
        if r:  # round 0 is the warm-up
            for v in variants:
                wall[v].append(step_wall[v])
                cpu[v].append(step_cpu[v])
    tokens, resp = batch[-1]  # the longest prompt
    peaks = {name: peak_bytes(model, tokens, resp, name) for name in layouts if name != "auto"}
    print(
        f"model: {params / 1e6:.1f}M params, {args.groups} prompts x {args.n} samples, prompts 64-256, "
        f"response {args.response}, {args.threads} threads; auto picks {picks}"
    )
    for (name, ent), ts in wall.items():
        label = name if ent else f"{name} (no entropy)"
        cs = cpu[(name, ent)]
        print(
            f"{label:28s} step {statistics.median(ts):7.2f} s wall ({', '.join(f'{t:.2f}' for t in ts)}), "
            f"{statistics.median(cs):7.2f} s cpu ({', '.join(f'{t:.2f}' for t in cs)})"
        )
    for name, b in peaks.items():
        print(f"{name:28s} peak {b / 2**20:8.1f} MiB (one micro-batch, prompt {len(tokens[0]) - resp[0]})")
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    pad, shared = ("padded", True), ("shared_prompt", True)
    extra = ""
    if ("auto", True) in med:
        extra += f" auto_over_padded={med[pad] / med[('auto', True)]:.3f}"
    if args.entropy:
        extra += f" entropy_cost={med[shared] / med[('shared_prompt', False)]:.3f}"
    print(
        f"shared_over_padded={med[pad] / med[shared]:.3f} shared_over_padded_cpu={med_cpu[pad] / med_cpu[shared]:.3f} "
        f"shared_peak_mem_ratio={peaks['padded'] / peaks['shared_prompt']:.3f} auto={auto}{extra}"
    )


if __name__ == "__main__":
    main()
