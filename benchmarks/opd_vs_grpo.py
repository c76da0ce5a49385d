"""On-policy distillation vs GRPO alone, same student, same samples: held-out eval reward curves.

Why: OPD should give a small student a denser signal than the task reward alone — every token
is compared with a stronger teacher — so its eval reward should rise faster per sample. This
runs the distillation example (`examples/distill/config.toml`: the reverse-digits GRPO policy,
hidden 128 x 4 layers, as the teacher; a hidden 64 x 2 layers student warm-started with the
mixed-rule SFT) with `verst train` once per variant, with identical rollout settings (8 prompts
x 8 samples per step, the same seeds and data order) and the same number of steps:

  grpo      opd.enabled = false                         (task reward only)
  opd       sampled-token OPD + task reward, the teacher scored by the embedded engine
  opd_topk  top-k OPD (k = 8, union, student-weighted) + task reward, the teacher in the trainer
            (only with --variants ... opd_topk)
  opd_topk_tail  the same with `opd.topk_tail = true` (the mass outside the set as one more token)

and reads `eval/heldout/reward_mean` (greedy, 300 held-out prompts) from each run's
`metrics.jsonl`.

Run (CPU, ~2-10 min on 2 shared cores):
  uv run python benchmarks/opd_vs_grpo.py
  uv run python benchmarks/opd_vs_grpo.py --variants grpo opd opd_topk opd_topk_tail

Last line: `opd_minus_grpo_eval=<mean over eval points after step 0 of (opd - grpo)>` (> 0: OPD
rises faster).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "distill" / "config.toml"
TRAINER_TEACHER = 'opd.teachers.reverse={type = "trainer", model_path = "model/teacher"}'
"""The example's teacher, run in the trainer (a whole table: the example's has an `engine`)."""
VARIANTS = {
    "grpo": ["opd.enabled=false"],
    "opd": ["opd.enabled=true"],
    "opd_topk": [
        "opd.enabled=true",
        "opd.log_prob_top_k=8",
        "opd.token_set=union",
        TRAINER_TEACHER,
    ],
    "opd_topk_tail": [
        "opd.enabled=true",
        "opd.log_prob_top_k=8",
        "opd.token_set=union",
        TRAINER_TEACHER,
        "opd.topk_tail=true",
    ],
}
"""Variant → `verst train` overrides on top of the example config."""
METRIC = "eval/heldout/reward_mean"


def eval_curve(run_dir: Path) -> dict[int, float]:
    """Step → held-out eval reward from a run's metrics.jsonl."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if METRIC in row:
            out[int(row["step"])] = float(row[METRIC])
    return out


def run(variant: str, args: argparse.Namespace) -> tuple[dict[int, float], float]:
    out = Path(args.output_dir) / variant
    cmd = [
        sys.executable, "-m", "verst.trainer.cli", "train", str(CONFIG), *VARIANTS[variant],
        f"run.num_steps={args.steps}", f"rollout.eval.interval={args.eval_interval}",
        f"run.output_dir={out}", f"run.name=opd_vs_grpo_{variant}",
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return eval_curve(out), time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--eval-interval", type=int, default=20)
    p.add_argument("--variants", nargs="+", default=["grpo", "opd"], choices=sorted(VARIANTS))
    p.add_argument("--output-dir", default="runs/opd_vs_grpo")
    args = p.parse_args()
    if "grpo" not in args.variants or "opd" not in args.variants:
        p.error("--variants must include grpo and opd")
    curves = {}
    for variant in args.variants:
        curve, seconds = run(variant, args)
        curves[variant] = curve
        print(
            f"{variant:13s} {seconds:6.0f} s  " + "  ".join(f"{s}:{r:.3f}" for s, r in sorted(curve.items()))
        )
    steps = sorted(set.intersection(*(set(c) for c in curves.values())))
    print("step          " + "".join(f"{s:>7d}" for s in steps))
    for variant, curve in curves.items():
        print(f"{variant:13s} " + "".join(f"{curve[s]:7.3f}" for s in steps))
    later = [s for s in steps if s > 0]
    gain = sum(curves["opd"][s] - curves["grpo"][s] for s in later) / max(len(later), 1)
    print(f"opd_minus_grpo_eval={gain:.3f}")


if __name__ == "__main__":
    main()
