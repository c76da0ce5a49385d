"""`verst report`: the dashboard's views of one or more runs as one self-contained HTML file.

The file holds plotly.js, the page script and every view the page asks for, precomputed:
overview, every curve, the per-step summary, each step's timeline (its first
`REPORT_TIMELINE_ROWS` attempts), each step's samples (its first `REPORT_SAMPLES_PER_STEP`
per split; search, filters and sorting apply to those in the page), the full trajectories of
those samples (at most `REPORT_TRAJECTORIES_PER_STEP` per step and split) and the runs'
comparison. It opens offline, from disk, in any browser.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from verst.trainer.dashboard.assets import page_html
from verst.trainer.dashboard.compare import compare_runs
from verst.trainer.dashboard.routes import run_entry
from verst.trainer.dashboard.run_data import RunData
from verst.trainer.dashboard.server import load_runs

REPORT_TIMELINE_ROWS = 2000
"""Attempts per step kept in a report."""
REPORT_SAMPLES_PER_STEP = 200
"""Samples per step and split kept in a report."""
REPORT_TRAJECTORIES_PER_STEP = 32
"""Full trajectories per step and split kept in a report (of the samples it keeps)."""


def build_report(paths: Sequence[str | Path], out: str | Path) -> Path:
    """Write the report of the runs at `paths` to `out`; returns its path."""
    runs = load_runs(paths)
    views: dict[str, object] = {"/api/runs": [run_entry(r) for r in runs]}
    for run in runs:
        run.refresh(force=True)
        base = f"/api/runs/{run.run_id}"
        views[f"{base}/overview"] = run.overview()
        views[f"{base}/curves"] = run.curves(None)
        steps = run.steps(budget_s=None)  # every step's summary, however long it takes
        views[f"{base}/steps"] = steps
        for row in steps["timeline_steps"]:
            views[f"{base}/timeline?step={row['step']}"] = run.timeline(
                row["step"], limit=REPORT_TIMELINE_ROWS
            )
        for step in steps["sample_steps"]:
            for split in run.sample_index.get(step, {}):
                views.update(_step_samples(run, base, step, split))
    views["/api/compare"] = compare_runs(runs)
    data = {"generated_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "views": views}
    text = json.dumps(data, default=str, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    title = "verst report: " + ", ".join(r.name for r in runs)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page_html(inline=True, data_json=text, title=title), encoding="utf-8")
    return out


def _step_samples(run: RunData, base: str, step: int, split: str) -> dict[str, object]:
    """The samples view of one step and split, and the full trajectories of its first rows."""
    page = run.samples(step, split=split, limit=REPORT_SAMPLES_PER_STEP)
    views: dict[str, object] = {f"{base}/samples?step={step}&split={split}": page}
    kept = 0
    for item in page["items"]:
        if not item["has_trajectory"]:
            continue
        if kept >= REPORT_TRAJECTORIES_PER_STEP:
            item["has_trajectory"] = False  # recorded, not carried by the report
            continue
        index = item["sample_index"]
        views[f"{base}/trajectory?step={step}&split={split}&sample={index}"] = run.trajectory(
            step, split, index
        )
        kept += 1
    return views
