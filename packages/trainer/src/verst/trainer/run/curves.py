"""`curves.png`: the training curves of a run, drawn from its `metrics.jsonl` (matplotlib, Agg).

Seven panels — reward, eval reward, response length, KL, entropy, clip fraction and the
train/rollout log-prob mismatch — each plotting the first metric present among its candidate
names (the trainer's names first, common aliases after). A panel with no data says so instead
of disappearing, so a missing metric is visible.
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "reward (train)",
        ("rollout/reward_mean", "rollout/reward", "train/reward_mean", "reward_mean", "reward"),
    ),
    ("eval reward", ("eval/reward_mean", "eval/*/reward_mean", "eval/reward", "eval_reward")),
    (
        "response length",
        (
            "rollout/response_len_mean",
            "rollout/response_length_mean",
            "rollout/response_length",
            "response_length",
        ),
    ),
    ("KL (to reference; else old→new policy)", ("train/kl", "train/kl_mean", "kl", "train/approx_kl")),
    ("entropy", ("train/entropy", "train/entropy_mean", "entropy")),
    ("clip fraction", ("train/clip_frac", "train/clipfrac", "train/clip_fraction", "clip_fraction")),
    (
        "train/rollout log-prob mismatch",
        (
            "train/logprob_abs_diff",
            "train/train_rollout_logprob_abs_diff",
            "train/logprob_mismatch",
            "train/rollout_logprob_abs_diff",
            "logprob_mismatch",
        ),
    ),
)
"""Panel title and candidate metric names, in order of preference."""


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics JSONL file (missing file → no rows; a torn last line is skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows


def pick_metric(rows: Iterable[dict[str, Any]], candidates: Sequence[str]) -> str | None:
    """The first candidate name (a glob like `eval/*/reward_mean` matches the first such key, sorted)
    that has at least one finite numeric value in `rows`."""
    rows = list(rows)
    present = sorted({key for row in rows for key, value in row.items() if _finite(value)})
    for pattern in candidates:
        matches = fnmatch.filter(present, pattern) if "*" in pattern else [pattern] * (pattern in present)
        if matches:
            return matches[0]
    return None


def series(rows: Iterable[dict[str, Any]], name: str) -> tuple[list[int], list[float]]:
    """Steps and values of one metric (rows without a finite value are skipped)."""
    xs, ys = [], []
    for row in rows:
        value = row.get(name)
        if _finite(value):
            xs.append(int(row["step"]))
            ys.append(float(value))
    return xs, ys


def plot_curves(metrics_path: str | Path, out_path: str | Path, title: str = "") -> Path:
    """Draw the seven panels from `metrics_path` into `out_path` (PNG); returns the path."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    rows = read_metrics(metrics_path)
    fig = Figure(figsize=(14, 7), dpi=100, layout="constrained")
    axes = fig.subplots(2, 4).ravel()
    for ax, (panel, candidates) in zip(axes, PANELS, strict=False):
        name = pick_metric(rows, candidates)
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if name is None:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
            continue
        xs, ys = series(rows, name)
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, linewidth=1.2)
        ax.set_ylabel(name, fontsize=7)
    axes[-1].axis("off")
    if title:
        fig.suptitle(title)
    out_path = Path(out_path)
    fig.savefig(out_path)
    return out_path


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
