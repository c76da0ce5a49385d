"""How fast `verst dashboard` opens a large run, switches steps and opens a full trajectory, in a
real browser.

Why: the scale target — a run with 200k lifecycle events, 50k samples and its full trajectories
at the recorded bound opens in a few seconds and stays responsive, because the server indexes,
aggregates and pages and the browser never loads everything at once. This measures it end to
end: a synthetic run directory in the formats a real run writes
(`verst.trainer.dashboard.synthetic`: 100 steps x 500 samples, 4 events per attempt, and
`trajectories.jsonl` holding, per step, the `--trajectories-per-step` first samples and every
failed or aborted one — the rule `run.record.trajectories_per_step` applies — each padded to
`--trajectory-tokens` tokens), a fresh dashboard server (so the first render includes reading
the files), headless Debian chromium driven by Playwright.

* first_render_s — navigation to `/#timeline` until the page has drawn the overview data, the
  step list and the newest step's timeline (500 attempts); the browser is already started.
* step_switch_s — median over 7 switches of choosing another step in the timeline's selector
  until that step's chart is drawn.
* samples_switch_s — the same in the samples table (each page marks which rows have a recorded
  trajectory, so it reads the trajectory index too).
* trajectory_open_s — median over 3 of clicking "view tokens" until the viewer has drawn every
  token of a `--trajectory-tokens`-token trajectory and its chart.

The baseline is the same measurement on a small run (10 steps x 50 samples, short trajectories)
in the same process; its line comes before the last. Targets: first_render_s <= 3,
step_switch_s <= 0.5.

Run (about 1-2 min; needs chromium: `apt-get install -y chromium`):
  uv run python benchmarks/dashboard_load.py
  uv run python benchmarks/dashboard_load.py --steps 200 --samples-per-step 250

The last line is `first_render_s=<s> step_switch_s=<s> samples_switch_s=<s> trajectory_open_s=<s>`.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from verst.trainer.dashboard.server import BackgroundServer
from verst.trainer.dashboard.synthetic import write_synthetic_run

CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _switch(page, selector: str, marker: str, target: int) -> float:
    t = time.perf_counter()
    page.select_option(selector, str(target))
    page.wait_for_selector(f"body[{marker}='{target}']", timeout=30_000)
    return time.perf_counter() - t


def measure(browser, run_dir: Path, steps: int) -> dict[str, float]:
    server = BackgroundServer([run_dir])
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    t0 = time.perf_counter()
    page.goto(server.url + "#timeline")
    page.wait_for_selector(f"body[data-ready='1'][data-timeline-step='{steps}']", timeout=60_000)
    out = {"first_render_s": time.perf_counter() - t0}
    targets = [1 + (k * 13) % max(1, steps - 1) for k in range(7)]
    out["step_switch_s"] = statistics.median(
        _switch(page, "#timeline-step", "data-timeline-step", s) for s in targets
    )
    page.click("a[data-tab='samples']")
    page.wait_for_selector("body[data-samples-step]")
    out["samples_switch_s"] = statistics.median(
        _switch(page, "#samples-step", "data-samples-step", s) for s in targets
    )
    opens = []
    for k in range(3):
        page.evaluate("delete document.body.dataset.trajectory")
        t = time.perf_counter()
        page.click(f"#samples-table button.open-trajectory >> nth={k}")
        page.wait_for_selector("body[data-trajectory] #trajectory-chart .main-svg", timeout=30_000)
        opens.append(time.perf_counter() - t)
    out["trajectory_open_s"] = statistics.median(opens)
    out["tokens_shown"] = page.locator("#trajectory-view .tok").count()
    page.close()
    server.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--samples-per-step", type=int, default=500)
    parser.add_argument("--trajectories-per-step", type=int, default=8)
    parser.add_argument("--trajectory-tokens", type=int, default=1024)
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        big = write_synthetic_run(
            Path(tmp) / "big",
            steps=args.steps,
            samples_per_step=args.samples_per_step,
            trajectories_per_step=args.trajectories_per_step,
            trajectory_tokens=args.trajectory_tokens,
            tool_turns=True,
        )
        small = write_synthetic_run(Path(tmp) / "small", steps=10, samples_per_step=50, tool_turns=True)
        count = {n: sum(1 for _ in (big / n).open("rb")) for n in ("lifecycle.jsonl", "samples.jsonl")}
        traj = big / "trajectories.jsonl"
        n_traj = sum(1 for _ in traj.open("rb"))
        print(
            f"synthetic run: {count['lifecycle.jsonl']} events, {count['samples.jsonl']} samples, "
            f"{n_traj} full trajectories ({traj.stat().st_size / 1e6:.0f} MB), "
            f"written in {time.perf_counter() - t:.1f} s",
            flush=True,
        )
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_FLAGS)
            base = measure(browser, small, 10)
            got = measure(browser, big, args.steps)
            browser.close()
    keys = ("first_render_s", "step_switch_s", "samples_switch_s", "trajectory_open_s")
    print(
        "baseline (10 steps x 50 samples): "
        + " ".join(f"baseline_{k}={base[k]:.3f}" for k in keys)
        + " "
        + " ".join(f"{k.removesuffix('_s')}_ratio={got[k] / base[k]:.2f}" for k in keys)
        + f" tokens_shown={got['tokens_shown']}"
    )
    print(" ".join(f"{k}={got[k]:.3f}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
