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

Before those lines, per run, the breakdown (`Probe`): when the page reached each milestone
(its performance marks), the renderer main thread's busy time (script / layout / style), the
server's own time and CPU per view (its `Server-Timing` header), this process's CPU time and
the bytes fetched — for the first render and per step switch — and the first trajectory open,
which loads plotly.js. On a loaded machine compare those, not the wall times.

Run (about 1-2 min; needs chromium: `apt-get install -y chromium`):
  uv run python benchmarks/dashboard_load.py
  uv run python benchmarks/dashboard_load.py --steps 200 --samples-per-step 250
  uv run python benchmarks/dashboard_load.py --data-dir /tmp/dashload   # keep the runs for next time

The last line is `first_render_s=<s> step_switch_s=<s> samples_switch_s=<s> trajectory_open_s=<s>`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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


_RENDERER = ("TaskDuration", "ScriptDuration", "LayoutDuration", "RecalcStyleDuration")
_RESOURCES = """() => performance.getEntriesByType('resource').map(r => ({
  api: new URL(r.name).pathname.startsWith('/api/'), bytes: r.encodedBodySize,
  server: Object.fromEntries((r.serverTiming || []).map(s => [s.name, s.duration / 1000]))}))"""
_MARKS = (
    "() => Object.fromEntries(performance.getEntriesByType('mark').map(m => [m.name, m.startTime / 1000]))"
)


class Probe:
    """CPU time and bytes of a stretch of the page's life: the renderer main thread's busy time
    (Chrome's Performance.getMetrics: script, layout, style, the rest), this process's CPU time
    (the dashboard server's threads), the bytes the page fetched and the server's own time per
    view (its `Server-Timing` header: wall and worker-thread CPU). Under load wall times inflate;
    these inflate far less."""

    def __init__(self, page) -> None:
        self.page, self.cdp = page, page.context.new_cdp_session(page)
        self.cdp.send("Performance.enable")

    def _metrics(self) -> dict[str, float]:
        return {m["name"]: m["value"] for m in self.cdp.send("Performance.getMetrics")["metrics"]}

    def start(self) -> None:
        self.m0, self.c0, self.n0 = self._metrics(), time.process_time(), self._count()

    def _count(self) -> int:
        try:
            return len(self.page.evaluate(_RESOURCES))
        except Exception:  # no document yet
            return 0

    def stop(self, repeats: int = 1) -> dict[str, float]:
        m1, cpu = self._metrics(), time.process_time() - self.c0
        res = self.page.evaluate(_RESOURCES)[self.n0 :]
        out = {k: (m1[k] - self.m0.get(k, 0.0)) / repeats for k in _RENDERER}
        out["python_cpu_s"] = cpu / repeats
        out["static_kb"] = sum(r["bytes"] for r in res if not r["api"]) / 1e3 / repeats
        out["json_kb"] = sum(r["bytes"] for r in res if r["api"]) / 1e3 / repeats
        out["server_view_s"] = sum(r["server"].get("view", 0.0) for r in res) / repeats
        out["server_cpu_s"] = sum(r["server"].get("cpu", 0.0) for r in res) / repeats
        return out


def _breakdown(label: str, got: dict[str, float]) -> str:
    return (
        f"  {label}: renderer busy {got['TaskDuration']:.3f} s (script {got['ScriptDuration']:.3f}, "
        f"layout {got['LayoutDuration']:.3f}, style {got['RecalcStyleDuration']:.3f}); "
        f"server views {got['server_view_s']:.3f} s wall / {got['server_cpu_s']:.3f} s CPU; "
        f"python process CPU {got['python_cpu_s']:.3f} s; fetched {got['static_kb']:.0f} kB page + "
        f"{got['json_kb']:.0f} kB JSON"
    )


def _switch(page, selector: str, marker: str, target: int) -> float:
    t = time.perf_counter()
    page.select_option(selector, str(target))
    page.wait_for_selector(f"body[{marker}='{target}']", timeout=30_000)
    return time.perf_counter() - t


def _first_render(page, probe: Probe, url: str, steps: int) -> dict[str, Any]:
    probe.start()
    t0 = time.perf_counter()
    page.goto(url + "#timeline")
    page.wait_for_selector(f"body[data-ready='1'][data-timeline-step='{steps}']", timeout=60_000)
    out: dict[str, Any] = {"first_render_s": time.perf_counter() - t0, "first": probe.stop()}
    marks = page.evaluate(_MARKS)
    nav = page.evaluate("() => performance.getEntriesByType('navigation')[0].domContentLoadedEventEnd / 1000")
    out["milestones"] = {"scripts run": nav, **{k.removeprefix("verst:"): v for k, v in marks.items()}}
    return out


def _trajectory_opens(page, n: int = 3) -> list[float]:
    opens = []
    for k in range(n):
        page.evaluate("delete document.body.dataset.trajectory")
        t = time.perf_counter()
        page.click(f"#samples-table button.open-trajectory >> nth={k}")
        page.wait_for_selector("body[data-trajectory] #trajectory-chart .main-svg", timeout=60_000)
        opens.append(time.perf_counter() - t)
    return opens


def measure(browser, run_dir: Path, steps: int) -> dict[str, Any]:
    server = BackgroundServer([run_dir])
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    probe = Probe(page)
    out = _first_render(page, probe, server.url, steps)
    targets = [1 + (k * 13) % max(1, steps - 1) for k in range(7)]
    probe.start()
    out["step_switch_s"] = statistics.median(
        _switch(page, "#timeline-step", "data-timeline-step", s) for s in targets
    )
    out["switch"] = probe.stop(repeats=len(targets))
    page.click("a[data-tab='samples']")
    page.wait_for_selector("body[data-samples-step]")
    out["samples_switch_s"] = statistics.median(
        _switch(page, "#samples-step", "data-samples-step", s) for s in targets
    )
    opens = _trajectory_opens(page)
    out["trajectory_open_s"] = statistics.median(opens)
    out["trajectory_first_open_s"] = opens[0]  # the first chart loads plotly.js
    marks = page.evaluate(_MARKS)
    out["plotly_load_s"] = marks.get("verst:plotly-ready", 0.0) - marks.get("verst:plotly-start", 0.0)
    out["tokens_shown"] = page.locator("#trajectory-view .tok").count()
    page.close()
    server.close()
    return out


def _report(label: str, got: dict[str, Any]) -> None:
    stones = ", ".join(f"{k} {v:.3f}" for k, v in sorted(got["milestones"].items(), key=lambda kv: kv[1]))
    print(f"{label}: first render {got['first_render_s']:.3f} s (page clock, s: {stones})")
    print(_breakdown("first render", got["first"]))
    print(_breakdown("per step switch", got["switch"]))
    print(
        f"  trajectory: first open {got['trajectory_first_open_s']:.3f} s (loads plotly.js: "
        f"{got['plotly_load_s']:.3f} s), median of 3 {got['trajectory_open_s']:.3f} s",
        flush=True,
    )


def _write_runs(root: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """The big and the small synthetic run under `root` (reused when a previous call wrote them)."""
    big, small = root / "big", root / "small"
    done = root / "written.json"
    spec = json.dumps(vars(args) | {"chromium": None, "data_dir": None}, sort_keys=True)
    if done.exists() and done.read_text() == spec:
        print(f"reusing the synthetic runs in {root}", flush=True)
        return big, small
    t = time.perf_counter()
    write_synthetic_run(
        big,
        steps=args.steps,
        samples_per_step=args.samples_per_step,
        trajectories_per_step=args.trajectories_per_step,
        trajectory_tokens=args.trajectory_tokens,
        tool_turns=True,
    )
    write_synthetic_run(small, steps=10, samples_per_step=50, tool_turns=True)
    count = {n: sum(1 for _ in (big / n).open("rb")) for n in ("lifecycle.jsonl", "samples.jsonl")}
    traj = big / "trajectories.jsonl"
    n_traj = sum(1 for _ in traj.open("rb"))
    print(
        f"synthetic run: {count['lifecycle.jsonl']} events, {count['samples.jsonl']} samples, "
        f"{n_traj} full trajectories ({traj.stat().st_size / 1e6:.0f} MB), "
        f"written in {time.perf_counter() - t:.1f} s",
        flush=True,
    )
    done.write_text(spec)
    return big, small


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--samples-per-step", type=int, default=500)
    parser.add_argument("--trajectories-per-step", type=int, default=8)
    parser.add_argument("--trajectory-tokens", type=int, default=1024)
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    parser.add_argument(
        "--data-dir", type=Path, help="write the synthetic runs here and reuse them on the next call"
    )
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with contextlib.ExitStack() as stack:
        root = args.data_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        big, small = _write_runs(root, args)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_FLAGS)
            base = measure(browser, small, 10)
            got = measure(browser, big, args.steps)
            browser.close()
    _report("baseline (10 steps x 50 samples)", base)
    _report(f"large run ({args.steps} steps x {args.samples_per_step} samples)", got)
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
