"""The runs' comparison table: configs side by side (differing fields marked), final and best metrics.

For each run: its name (`run.name`), state, total wall time, every config field (flattened,
`train.lr`), and for each metric the last logged value (`final`) and — for reward-like metrics,
where higher is better — the best value and the step it was logged at.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from verst.trainer.dashboard.run_data import RunData

HIGHER_IS_BETTER = re.compile(r"reward|accuracy|acc\b|score|pass|success")
"""Metrics whose best value is their maximum (the others get no 'best')."""
_SKIP_CONFIG = re.compile(r"(^|\.)(output_dir|path)$")
"""Fields that differ between any two runs by construction; listed, never marked as a difference."""


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested tables as dotted keys (`{"train": {"lr": 1}}` -> `{"train.lr": 1}`)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and value:
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


def metric_stats(metrics: Sequence[dict[str, Any]], name: str) -> dict[str, Any] | None:
    """final (last logged), and for reward-like metrics best (max) and best_step."""
    points = [(m["step"], m[name]) for m in metrics if isinstance(m.get(name), int | float)]
    if not points:
        return None
    out: dict[str, Any] = {"final": points[-1][1], "final_step": points[-1][0]}
    if HIGHER_IS_BETTER.search(name):
        step, value = max(points, key=lambda p: (p[1], -p[0]))
        out.update(best=value, best_step=step)
    return out


def compare_runs(runs: Sequence[RunData]) -> dict[str, Any]:
    """The comparison of `runs` (each already refreshed)."""
    configs = [flatten(r.config) for r in runs]
    keys = sorted(set().union(*configs)) if configs else []
    differing = [
        k
        for k in keys
        if not _SKIP_CONFIG.search(k) and len({repr(c.get(k, "<absent>")) for c in configs}) > 1
    ]
    names = sorted(set().union(*(r.metric_names for r in runs))) if runs else []
    rows = []
    for run, config in zip(runs, configs, strict=True):
        status = run.status()
        rows.append(
            {
                "id": run.run_id,
                "name": run.name,
                "folder": run.root.name,
                "state": status["state"],
                "step": status["step"],
                "total_steps": status["total_steps"],
                "wall_s": status["wall_s"],
                "config": config,
                "metrics": {n: s for n in names if (s := metric_stats(run.metrics, n)) is not None},
            }
        )
    return {"runs": rows, "config_keys": keys, "differing": differing, "metrics": names}
