"""How fast `verst dashboard` opens a large run and switches timeline steps, in a real browser.

Why: the issue's scale target — a run with 200k lifecycle events and 50k samples opens in a
few seconds and stays responsive, because the server aggregates and pages and the browser
never loads everything at once. This measures it end to end: a synthetic run directory in the
formats a real run writes (`verst.trainer.dashboard.synthetic`: 100 steps x 500 samples, 4
events per attempt), a fresh dashboard server (so the first render includes reading the files),
headless Debian chromium driven by Playwright.

* first_render_s — navigation to `/#timeline` until the page has drawn the overview data, the
  step list and the newest step's timeline (500 attempts); the browser is already started.
* step_switch_s — median over 7 switches of choosing another step in the timeline's selector
  until that step's chart is drawn.

The baseline is the same measurement on a small run (10 steps x 50 samples) in the same
process; its line comes before the last. Targets: first_render_s <= 3, step_switch_s <= 0.5.

Run (about 30 s; needs chromium: `apt-get install -y chromium`):
  uv run python benchmarks/dashboard_load.py
  uv run python benchmarks/dashboard_load.py --steps 200 --samples-per-step 250

The last line is `first_render_s=<s> step_switch_s=<s>`.
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


def measure(browser, run_dir: Path, steps: int) -> tuple[float, float]:
    server = BackgroundServer([run_dir])
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    t0 = time.perf_counter()
    page.goto(server.url + "#timeline")
    page.wait_for_selector(f"body[data-ready='1'][data-timeline-step='{steps}']", timeout=60_000)
    first = time.perf_counter() - t0
    switches = []
    for k in range(7):
        target = 1 + (k * 13) % max(1, steps - 1)
        t1 = time.perf_counter()
        page.select_option("#timeline-step", str(target))
        page.wait_for_selector(f"body[data-timeline-step='{target}']", timeout=30_000)
        switches.append(time.perf_counter() - t1)
    page.close()
    server.close()
    return first, statistics.median(switches)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--samples-per-step", type=int, default=500)
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        big = write_synthetic_run(Path(tmp) / "big", steps=args.steps, samples_per_step=args.samples_per_step)
        small = write_synthetic_run(Path(tmp) / "small", steps=10, samples_per_step=50)
        n_events = sum(1 for _ in (big / "lifecycle.jsonl").open("rb"))
        n_samples = sum(1 for _ in (big / "samples.jsonl").open("rb"))
        print(
            f"synthetic run: {n_events} events, {n_samples} samples, written in {time.perf_counter() - t:.1f} s",
            flush=True,
        )
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
            base_first, base_switch = measure(browser, small, 10)
            first, switch = measure(browser, big, args.steps)
            browser.close()
    print(
        f"baseline (10 steps x 50 samples): baseline_first_render_s={base_first:.3f} "
        f"baseline_step_switch_s={base_switch:.3f} first_render_ratio={first / base_first:.2f} "
        f"step_switch_ratio={switch / base_switch:.2f}"
    )
    print(f"first_render_s={first:.3f} step_switch_s={switch:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
