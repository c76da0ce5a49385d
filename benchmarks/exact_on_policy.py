"""The cost of `train.exact_on_policy`: whole `verst train` steps with it on against off.

Why: exactly on-policy runs the embedded engine and the trainer on batch-invariant ops
(`verst.rollout.exact_ops`: row-padded GEMMs, a position-aligned blocked attention, the model
forward instead of the engine's direct decode step, padded rows instead of shared prompts in
the trainer). What that costs is the ratio of step times, measured here in one process,
interleaved (off, on, off, on, ...): the median over the pairs (an off run, the on run after it)
of the ratio of their median `time/step_s` over each run's steps after the first (load that
drifts over minutes hits both runs of a pair alike); the mismatch it removes is the sum of
`rollout/mismatch_tokens` over the exact runs.

Two models: the example's tiny Llama (reverse_digits as configured, 8 x 8 samples), and the
31.5M-parameter shape of `benchmarks/vs_trl_scale.py` ("small": hidden 384, 8 layers, 6 heads /
2 KV heads, MLP 1024, vocabulary 49,152, tied embeddings; random weights, seed 0), run with the
reverse_digits prompts and tokenizer (ids past its 64 characters decode to nothing).

Run:  uv run python benchmarks/exact_on_policy.py [--size tiny|small|both --steps 4 --repeats 3]
Last line: exact_over_default_step_time=<ratio, the larger model's> mismatch_tokens=<sum> ...
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "reverse_digits"
CACHE = ROOT / "runs" / "bench-cache"
SMALL = dict(
    hidden_size=384, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2, intermediate_size=1024
)  # fmt: skip  (vs_trl_scale.SIZES["small"])


def small_checkpoint() -> Path:
    """The 31.5M shape with the example's tokenizer (cached under runs/bench-cache)."""
    out = CACHE / "exact-small"
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(EXAMPLE / "model" / "warm_start")
    cfg = LlamaConfig(
        vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, hidden_act="silu", initializer_range=0.041666666666666664,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        **SMALL,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run(work: Path, size: str, exact: bool, steps: int, tag: str) -> tuple[list[float], float]:
    """One `verst train` run in this process: (step times after the first, mismatch tokens)."""
    from verst.trainer.cli import main

    out = work / tag
    eval_path = work / "eval.jsonl"
    if not eval_path.exists():
        rows = (EXAMPLE / "data" / "eval.jsonl").read_text().splitlines()[:8]
        eval_path.write_text("\n".join(rows) + "\n")
    args = ["train", str(EXAMPLE / "config.toml"), f'run.output_dir="{out}"', f"run.num_steps={steps}",
            "run.save_interval=0", "rollout.eval.interval=0", f'rollout.eval.datasets.heldout.path="{eval_path}"',
            f"train.exact_on_policy={str(exact).lower()}"]  # fmt: skip
    if size == "small":
        model = small_checkpoint()
        args += [f'engine.model_path="{model}"', f'train.model_path="{model}"', "rollout.max_response_len=32",
                 "train.micro_batch_size=16", "train.lr=1e-5"]  # fmt: skip
    code = main(args)
    if code != 0:
        raise SystemExit(f"verst train exited with {code} ({tag})")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in rows if "train/loss" in r]
    times = [r["time/step_s"] for r in steps_[1:]]
    mismatch = sum(r.get("rollout/mismatch_tokens", 0.0) for r in steps_)
    shutil.rmtree(out, ignore_errors=True)
    return times, mismatch


def measure(size: str, steps: int, repeats: int) -> tuple[float, float, float, float]:
    """(median step time off, on, the median of the paired ratios, mismatch tokens of the exact
    runs). Each pair is an off run and the on run right after it, their median step times'
    ratio: load that drifts over minutes (a shared box) hits both runs of a pair alike."""
    off: list[float] = []
    on: list[float] = []
    ratios: list[float] = []
    mismatch = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for i in range(repeats):
            a, _ = run(work, size, False, steps, f"off{i}")
            b, m = run(work, size, True, steps, f"on{i}")
            off += a
            on += b
            ratios.append(statistics.median(b) / statistics.median(a))
            mismatch += m
    a, b, r = statistics.median(off), statistics.median(on), statistics.median(ratios)
    print(f"size={size} steps={steps} repeats={repeats} default_step_s={a:.3f} exact_step_s={b:.3f} "
          f"ratio={r:.3f} pair_ratios={','.join(f'{x:.3f}' for x in sorted(ratios))} "
          f"mismatch_tokens={mismatch:.0f}", flush=True)  # fmt: skip
    return a, b, r, mismatch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=("tiny", "small", "both"), default="both")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    sizes = ("tiny", "small") if a.size == "both" else (a.size,)
    results = {s: measure(s, a.steps, a.repeats) for s in sizes}
    parts = " ".join(f"{s}_ratio={r[2]:.3f}" for s, r in results.items())
    last = results[sizes[-1]]
    total = sum(r[3] for r in results.values())
    print(f"exact_over_default_step_time={last[2]:.3f} mismatch_tokens={total:.0f} {parts}")


if __name__ == "__main__":
    main()
