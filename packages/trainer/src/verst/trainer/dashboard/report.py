"""`verst report`: the dashboard's views of one or more runs as one self-contained HTML file.

The file holds plotly.js, the page script and every view the page asks for, precomputed:
overview, every curve, the per-step summary, each step's timeline (its first
`REPORT_TIMELINE_ROWS` attempts) and each step's samples (its first `REPORT_SAMPLES_PER_STEP`
per split; search filters those in the page). It opens offline, from disk, in any browser.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

from verst.trainer.dashboard.assets import page_html
from verst.trainer.dashboard.server import load_runs

REPORT_TIMELINE_ROWS = 2000
"""Attempts per step kept in a report."""
REPORT_SAMPLES_PER_STEP = 200
"""Samples per step and split kept in a report."""


def build_report(paths: Sequence[str | Path], out: str | Path) -> Path:
    """Write the report of the runs at `paths` to `out`; returns its path."""
    runs = load_runs(paths)
    views: dict[str, object] = {
        "/api/runs": [{"id": r.run_id, "name": r.name, "path": str(r.root)} for r in runs]
    }
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
                views[f"{base}/samples?step={step}&split={split}"] = run.samples(
                    step, split=split, limit=REPORT_SAMPLES_PER_STEP
                )
    data = {"generated_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "views": views}
    text = json.dumps(data, default=str, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    title = "verst report: " + ", ".join(r.name for r in runs)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page_html(inline=True, data_json=text, title=title), encoding="utf-8")
    return out
