"""The cost of `train.exact_on_policy`: whole `verst train` steps with it on against off.

Why: exactly on-policy runs the embedded engine and the trainer on batch-invariant ops
(`verst.rollout.exact_ops`: row-padded GEMMs, an attention whose sums over keys run in position
order, `exact_silu`, the exact LM head; docs/training.md lists them). What that costs is the
ratio of step times. Both runs (off and on, the same config and seeds) are built in this process
and their steps interleaved: off's step i, then on's step i, and so on. The ratio reported is the
median over steps of on's step time over the off step just before it (seconds apart, so the
load of a shared or drifting box, which moves over minutes and swung whole-run ratios by
0.9-1.5x, hits both alike), with its quartiles, the first step of each run (warm-up) left out;
also the ratio of the rollout and train phases' totals, and the mismatch it removes (the sum of
`rollout/mismatch_tokens` over the exact run, which must be 0).

Two models: the example's tiny Llama (reverse_digits as configured, 8 x 8 samples), and the
31.5M-parameter shape of `benchmarks/vs_trl_scale.py` ("small": hidden 384, 8 layers, 6 heads /
2 KV heads, MLP 1024, vocabulary 49,152, tied embeddings; random weights, seed 0), run with the
reverse_digits prompts and tokenizer (ids past its 64 characters decode to nothing).

Run:  uv run python benchmarks/exact_on_policy.py [--size tiny|small|both --steps 12]
Last line: exact_over_default_step_time=<ratio, the larger model's> mismatch_tokens=<sum> ...
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

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


def build(work: Path, size: str, exact: bool, steps: int, tag: str) -> Any:
    """A `verst train` run (the README's config and these overrides) built in this process."""
    from verst.trainer.cli import load_config_and_env
    from verst.trainer.run.controller import Trainer

    eval_path = work / "eval.jsonl"
    if not eval_path.exists():
        rows = (EXAMPLE / "data" / "eval.jsonl").read_text().splitlines()[:8]
        eval_path.write_text("\n".join(rows) + "\n")
    args = [f'run.output_dir="{work / tag}"', f"run.num_steps={steps}", "run.save_interval=0",
            "rollout.eval.interval=0", f'rollout.eval.datasets.heldout.path="{eval_path}"',
            f"train.exact_on_policy={str(exact).lower()}"]  # fmt: skip
    if size == "small":
        model = small_checkpoint()
        args += [f'engine.model_path="{model}"', f'train.model_path="{model}"', "rollout.max_response_len=32",
                 "train.micro_batch_size=16", "train.lr=1e-5"]  # fmt: skip
    cfg, env = load_config_and_env(str(EXAMPLE / "config.toml"), args)
    return Trainer(cfg, work / tag, env=env)


def measure(size: str, steps: int) -> dict[str, float]:
    """Both runs built side by side, their steps interleaved (off's step i, then on's); the first
    step of each (warm-up) is left out. Returns the median step times, the median over steps of
    the paired ratio (on's step over the off step just before it: seconds apart, so load that
    drifts over minutes hits both alike), its quartiles, the ratio of the phases' totals, and
    the exact run's mismatch tokens."""
    from verst.trainer.run.controller import TrainingSummary

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        runs = {"off": build(work, size, False, steps, "off"), "on": build(work, size, True, steps, "on")}
        times: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
        try:
            summaries = {k: TrainingSummary(work / k, 0, 0, 0) for k in runs}
            for step in range(steps):
                for k, trainer in runs.items():
                    if not trainer._step(step, summaries[k]):
                        raise SystemExit(f"{k}: step {step} was interrupted")
                    times[k].append(trainer.logger.records[-1][1])
        finally:
            for trainer in runs.values():
                trainer.close()
    off, on = times["off"][1:], times["on"][1:]
    ratios = sorted(b["time/step_s"] / a["time/step_s"] for a, b in zip(off, on, strict=True))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3

    def total(rows: list[dict[str, float]], phase: str) -> float:
        return sum(r[f"time/{phase}_s"] for r in rows)

    out = {
        "default_step_s": statistics.median(r["time/step_s"] for r in off),
        "exact_step_s": statistics.median(r["time/step_s"] for r in on),
        "ratio": statistics.median(ratios),
        "q1": q[0],
        "q3": q[2],
        "rollout_ratio": total(on, "rollout") / total(off, "rollout"),
        "train_ratio": total(on, "train") / total(off, "train"),
        "mismatch_tokens": sum(r.get("rollout/mismatch_tokens", 0.0) for r in times["on"]),
    }
    print(f"size={size} steps={steps} " + " ".join(f"{k}={v:.3f}" for k, v in out.items()), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=("tiny", "small", "both"), default="both")
    p.add_argument("--steps", type=int, default=12, help="steps of each run (the first is a warm-up)")
    a = p.parse_args()
    sizes = ("tiny", "small") if a.size == "both" else (a.size,)
    results = {s: measure(s, a.steps) for s in sizes}
    parts = " ".join(f"{s}_ratio={r['ratio']:.3f}" for s, r in results.items())
    total = sum(r["mismatch_tokens"] for r in results.values())
    print(
        f"exact_over_default_step_time={results[sizes[-1]]['ratio']:.3f} mismatch_tokens={total:.0f} {parts}"
    )


if __name__ == "__main__":
    main()
