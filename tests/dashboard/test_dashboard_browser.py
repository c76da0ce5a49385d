"""`verst dashboard` and `verst report` in a real headless browser, driven by Playwright: a system
chromium or google-chrome on PATH, else Playwright's managed chromium (`browser_testlib`). With
none they skip with one line saying how to install one; `.ci/run` installs Debian's chromium and
sets `VERST_REQUIRE_BROWSER=1`, so there a missing browser fails instead.

One short real run per module — 3 steps of the reverse-digits example through `verst train` in a
subprocess, with a 16-prompt eval set — watched live by the page while it runs (the process is
paused with SIGSTOP while the page loads, so the page provably starts before the last step),
then checked against the run's files: the overview's step count, the timeline's number of
attempts for a step, a sample's reward. The timeline screenshot is kept in `test-artifacts/`
(or `$VERST_TEST_ARTIFACTS`). The report of the same run opens from disk with every network
request refused.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verst.trainer.cli import main
from verst.trainer.dashboard.server import BackgroundServer

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "reverse_digits"
ARTIFACTS = Path(os.environ.get("VERST_TEST_ARTIFACTS") or REPO / "test-artifacts")
STEPS = 3


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def run_process(tmp_path_factory):
    """A 3-step reverse-digits run started in a subprocess (the live test watches it)."""
    tmp = tmp_path_factory.mktemp("dashboard_run")
    rows = (EXAMPLE / "data" / "eval.jsonl").read_text().splitlines()[:16]
    (tmp / "eval.jsonl").write_text("\n".join(rows) + "\n")
    run = tmp / "run"
    cmd = [
        sys.executable, "-m", "verst.trainer.cli", "train", str(EXAMPLE / "config.toml"),
        f'run.output_dir="{run}"', f"run.num_steps={STEPS}", "run.save_interval=0",
        "rollout.eval.interval=0", f'rollout.eval.datasets.heldout.path="{tmp / "eval.jsonl"}"',
    ]  # fmt: skip
    log = (tmp / "train.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    yield proc, run, tmp / "train.log"
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()
    log.close()


@pytest.fixture(scope="module")
def finished_run(run_process):
    proc, run, log = run_process
    if proc.wait(timeout=300) != 0:
        pytest.fail("the training run failed:\n" + log.read_text()[-3000:])
    return run


def _step_text(page) -> str:
    return page.locator("#overview-step").inner_text()


@pytest.mark.timeout(400)
def test_live_run_shows_new_steps_without_reload(browser, run_process):
    proc, run, log = run_process
    deadline = time.monotonic() + 240
    while not (run / "status.json").exists():
        assert proc.poll() is None, "the run ended before writing status.json:\n" + log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no status.json after 240 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGSTOP)  # hold the run while the page loads
    try:
        step_now = json.loads((run / "status.json").read_text())["step"]
        assert step_now < STEPS
        with BackgroundServer([run]) as server:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            page.goto(server.url + "#overview")
            page.wait_for_selector("body[data-ready='1']")
            assert _step_text(page) == f"{step_now} / {STEPS}"
            assert page.locator("#overview-state").inner_text() == "running"
            navigations = []
            page.on("framenavigated", lambda frame: navigations.append(frame.url))
            proc.send_signal(signal.SIGCONT)
            page.wait_for_function(
                f"document.querySelector('#overview-step').textContent === '{STEPS} / {STEPS}'",
                timeout=240_000,
            )
            page.wait_for_function(
                "document.querySelector('#overview-state').textContent === 'finished'", timeout=120_000
            )
            assert navigations == []  # updated in place, never reloaded
            page.close()
    finally:
        proc.send_signal(signal.SIGCONT)


@pytest.mark.timeout(300)
def test_dashboard_numbers_equal_the_run_files(browser, finished_run):
    run = finished_run
    events = _lines(run / "lifecycle.jsonl")
    samples = [s for s in _lines(run / "samples.jsonl") if s["split"] == "train"]
    metrics = _lines(run / "metrics.jsonl")
    with BackgroundServer([run]) as server:
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(server.url + "#overview")
        page.wait_for_selector("body[data-ready='1']")
        assert _step_text(page) == f"{max(m['step'] for m in metrics)} / {STEPS}"
        assert page.locator("#overview-state").inner_text() == "finished"
        assert page.locator("#overview-events").inner_text() == str(len(events))

        page.click("a[data-tab='timeline']")
        for step in (2, 1):
            page.select_option("#timeline-step", str(step))
            page.wait_for_selector(f"body[data-timeline-step='{step}']")
            attempts = {
                (e["group_index"], e["sample_index"], e["detail"].get("attempt"))
                for e in events
                if e["rollout_id"] == step - 1 and e["kind"] == "attempt_start"
            }
            assert page.locator("#timeline-count").get_attribute("data-attempts") == str(len(attempts))
        # one queued bar per attempt row and each attempt's generating span drawn (a subpath each)
        bars = "ps => ps.reduce((n, p) => n + p.getAttribute('d').split('M').length - 1, 0)"
        assert page.eval_on_selector_all("#timeline-chart path.queued", bars) == len(attempts)
        assert page.eval_on_selector_all("#timeline-chart path.gen", bars) >= len(attempts)
        # hovering the first generating bar names its attempt and times
        x, y = page.evaluate(
            """() => { const p = document.querySelector('#timeline-chart path.gen');
            p.ownerSVGElement.scrollIntoView(); const box = p.ownerSVGElement.getBoundingClientRect();
            const [, x, y, w, h] = p.getAttribute('d').match(/^M([\\d.]+) ([\\d.]+)h([\\d.]+)v([\\d.]+)/).map(Number);
            return [box.left + x + w / 2, box.top + y + h / 2]; }"""
        )
        page.mouse.move(x, y)
        tip = page.locator("#timeline-chart .chart-tip").inner_text()
        label = tip.split(" — ")[0].split()
        hovered = (int(label[0][1:]), int(label[1][1:]), int(label[2][1:]))
        assert hovered in attempts and "generating" in tip
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "dashboard_timeline.png"
        page.screenshot(path=str(shot))
        assert shot.stat().st_size > 10_000

        page.click("a[data-tab='samples']")
        page.select_option("#samples-step", "2")
        page.wait_for_selector("body[data-samples-step='2']")
        mine = next(s for s in samples if s["step"] == 2 and s["sample_index"] == 9)
        page.fill("#sample-search", mine["response"])
        page.wait_for_function(
            "document.querySelector('#samples-table tbody tr') && "
            "[...document.querySelectorAll('#samples-table tbody tr')].some(r => r.dataset.sample === '9')"
        )
        row = page.locator("#samples-table tbody tr[data-sample='9']")
        assert float(row.get_attribute("data-reward")) == pytest.approx(mine["reward"])
        assert mine["prompt"] in row.inner_text()

        page.click("a[data-tab='curves']")
        page.wait_for_function("document.body.dataset.curves && document.body.dataset.curves.length > 0")
        assert "rollout/reward_mean" in page.evaluate("document.body.dataset.curves")
        assert errors == []
        page.close()


@pytest.mark.timeout(300)
def test_report_opens_offline_with_the_same_views(browser, finished_run, tmp_path):
    out = tmp_path / "report.html"
    assert main(["report", str(finished_run), "-o", str(out)]) == 0
    html = out.read_text()
    assert "<script src=" not in html and "<link " not in html  # everything inline
    events = _lines(finished_run / "lifecycle.jsonl")
    context = browser.new_context()
    requests = []

    def refuse(route):
        requests.append(route.request.url)
        route.abort()

    context.route("http://*/**", refuse)
    context.route("https://*/**", refuse)
    page = context.new_page()
    page.goto(out.as_uri() + "#timeline")
    page.wait_for_selector("body[data-ready='1']")
    assert page.locator("#timeline-count").get_attribute("data-attempts") == str(
        len({(e["group_index"], e["sample_index"]) for e in events if e["rollout_id"] == STEPS - 1})
    )
    page.click("a[data-tab='overview']")
    page.wait_for_selector("#overview-step")
    assert _step_text(page) == f"{STEPS} / {STEPS}"
    page.click("a[data-tab='samples']")
    page.wait_for_selector("body[data-samples-step]")
    assert int(page.locator("#samples-count").get_attribute("data-total")) == 64
    assert requests == []
    context.close()


@pytest.mark.timeout(120)
def test_curves_overlay_runs_and_smooth(browser, tmp_path):
    from verst.trainer.dashboard.synthetic import write_synthetic_run

    runs = [
        write_synthetic_run(tmp_path / name, steps=6, samples_per_step=8, seed=i)
        for i, name in enumerate("ab")
    ]
    with BackgroundServer(runs) as server:
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        page.goto(server.url + "#curves")
        page.wait_for_function("document.body.dataset.curves === 'rollout/reward_mean'")  # rollout/ open
        chart = "document.querySelector(\"[data-key='curve-rollout/reward_mean']\")"
        names = page.evaluate(f"{chart}.data.map(t => t.name)")
        assert names == ["a", "b"]  # both runs overlaid
        ys = page.evaluate(f"{chart}.data[0].y")
        expected = [m["rollout/reward_mean"] for m in _lines(runs[0] / "metrics.jsonl")]
        assert ys == pytest.approx(expected)
        page.evaluate("document.querySelector('#smoothing').value = '0.9'")
        page.dispatch_event("#smoothing", "input")
        page.wait_for_function(f"{chart}.data.length === 4")  # raw (faint) + smoothed per run
        smoothed = page.evaluate(f"{chart}.data[1].y")
        acc, want = 0.0, []
        for n, y in enumerate(expected, 1):
            acc = 0.9 * acc + 0.1 * y
            want.append(acc / (1 - 0.9**n))
        assert smoothed == pytest.approx(want)
        page.close()
