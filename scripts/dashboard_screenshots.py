"""The screenshots of docs/dashboard.md, from real runs: two short tool_math runs (different
learning rates) through `verst train`, then the dashboard in headless chromium — the trajectory
viewer on an episode that calls the tool, the Curves tab's grouped panels, the Compare tab.

Run (a few minutes on CPU; needs chromium: `apt-get install -y chromium`):
  uv run python scripts/dashboard_screenshots.py            # writes docs/images/dashboard_*.png
  uv run python scripts/dashboard_screenshots.py --out /tmp/shots --steps 3
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tool_math"
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def train(run: Path, name: str, lr: float, steps: int, eval_file: Path) -> None:
    cmd = [
        sys.executable, "-m", "verst.trainer.cli", "train", str(EXAMPLE / "config.toml"),
        f'run.output_dir="{run}"', f'run.name="{name}"', f"run.num_steps={steps}", "run.save_interval=0",
        f"train.lr={lr}", "rollout.eval.interval=0", f'rollout.eval.datasets.heldout.path="{eval_file}"',
    ]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=run.parent)


def tool_episode(run: Path, step: int) -> int:
    """The sample index of a recorded episode of `step` that called the tool and was rewarded."""
    from verst.trainer.dashboard.trajectories import read_trajectories

    best = None
    for t in read_trajectories(run, step=step, split="train"):
        envs = [s for s in t["segments"] if s["source"] == "env"]
        if envs and (best is None or (t["reward"] or 0) > (best["reward"] or 0)):
            best = t
    if best is None:
        raise SystemExit(f"no recorded episode of step {step} in {run} called the tool; run more steps")
    return best["sample_index"]


def shoot(runs: list[Path], out: Path, step: int, chromium: str) -> None:
    from playwright.sync_api import sync_playwright

    from verst.trainer.dashboard.server import BackgroundServer

    index = tool_episode(runs[0], step)
    with sync_playwright() as p, BackgroundServer(runs) as server:
        browser = p.chromium.launch(executable_path=chromium, args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 860})
        page.goto(server.url + "#samples")
        page.wait_for_selector("body[data-ready='1']")
        page.select_option("#samples-step", str(step))
        page.wait_for_selector(f"body[data-samples-step='{step}']")
        page.click(f"#samples-table button.open-trajectory[data-sample='{index}']")
        page.wait_for_selector("body[data-trajectory] #trajectory-chart .main-svg")
        page.select_option("#token-color", "logprob")
        page.wait_for_selector("#trajectory-chart .main-svg")
        page.locator("#trajectory-view").screenshot(path=str(out / "dashboard_trajectory.png"))
        page.click("a[data-tab='curves']")
        page.wait_for_function("(document.body.dataset.curves || '').includes('rollout/')")
        page.click("#curve-panels details[data-group='train'] > summary")
        page.wait_for_function("(document.body.dataset.curves || '').includes('train/')")
        page.wait_for_timeout(500)
        page.screenshot(path=str(out / "dashboard_curves.png"))
        page.click("a[data-tab='compare']")
        page.wait_for_selector("body[data-compare='2']")
        page.locator("#compare-table").screenshot(path=str(out / "dashboard_compare.png"))
        browser.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows = (EXAMPLE / "data" / "eval.jsonl").read_text().splitlines()[:16]
        (tmp / "eval.jsonl").write_text("\n".join(rows) + "\n")
        runs = [tmp / "lr_1e-4", tmp / "lr_3e-4"]
        train(runs[0], "tool_math lr=1e-4", 1e-4, args.steps, tmp / "eval.jsonl")
        train(runs[1], "tool_math lr=3e-4", 3e-4, args.steps, tmp / "eval.jsonl")
        shoot(runs, args.out, args.steps, args.chromium)
    print(
        f"wrote {', '.join(f'dashboard_{n}.png' for n in ('trajectory', 'curves', 'compare'))} to {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
