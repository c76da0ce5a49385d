"""Plot two or more runs' curves on shared axes (e.g. GRPO vs PPO + GAE on reverse_digits).

Why: docs/algorithms.md compares algorithms on the same task and budget; this draws the figure
from the runs' own `metrics.jsonl` files: held-out eval reward, train reward (moving average),
both against the step and against wall-clock seconds, and the critic's value loss where a run
has one.

Run:  uv run python scripts/plot_algorithm_curves.py GRPO=runs/reverse_digits \
          "PPO + GAE=runs/reverse_digits_ppo" --out docs/images/reverse_digits_grpo_vs_ppo.png \
          --title "reverse_digits, same budget (measured under load)"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def series(rows: list[dict], key: str) -> tuple[list[float], list[float], list[float]]:
    """(steps, seconds since the first row, values) of the rows that have `key`."""
    t0 = rows[0]["time"]
    picked = [r for r in rows if key in r]
    return [r["step"] for r in picked], [r["time"] - t0 for r in picked], [r[key] for r in picked]


def smooth(values: list[float], k: int = 10) -> list[float]:
    return [
        sum(values[max(0, i - k + 1) : i + 1]) / len(values[max(0, i - k + 1) : i + 1])
        for i in range(len(values))
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="LABEL=run_dir")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="")
    ap.add_argument("--eval-key", default="eval/heldout/reward_mean")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for spec in args.runs:
        label, path = spec.split("=", 1)
        rows = read(Path(path))
        steps, secs, ev = series(rows, args.eval_key)
        (line,) = axes[0, 0].plot(steps, ev, marker="o", label=label)
        axes[0, 1].plot(secs, ev, marker="o", label=label, color=line.get_color())
        s, _, r = series(rows, "rollout/reward_mean")
        axes[1, 0].plot(s, smooth(r), label=f"{label} (10-step mean)", color=line.get_color())
        s, _, vf = series(rows, "train/critic/vf_loss")
        if vf:
            axes[1, 1].plot(s, vf, label=f"{label}: critic value loss", color=line.get_color())
    axes[0, 0].set(xlabel="step", ylabel="held-out eval reward (greedy)")
    axes[0, 1].set(xlabel="wall-clock seconds", ylabel="held-out eval reward (greedy)")
    axes[1, 0].set(xlabel="step", ylabel="train reward")
    axes[1, 1].set(xlabel="step", ylabel="value loss", yscale="log")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
