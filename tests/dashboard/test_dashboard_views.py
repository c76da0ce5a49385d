"""The dashboard's views in a real headless chromium (Playwright), each checked against the run's
files: the trajectory viewer's tokens, masks and segments equal the recorded trajectory; the
comparison table's values equal the runs' configs and metrics; sorting and filtering the samples
table return the rows the same rules give on `samples.jsonl` (served and in the offline report);
chart panels group by prefix, and their CSV / PNG exports equal the data.

The runs are synthetic (`verst.trainer.dashboard.synthetic`, written through the run's own
writers: `sample_record`, `trajectory_record`, `append_turn`), so the module needs no training
and uses the folder's one browser (`conftest.py`).
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from verst.trainer.cli import main
from verst.trainer.dashboard.server import BackgroundServer
from verst.trainer.dashboard.synthetic import write_synthetic_run
from verst.trainer.dashboard.trajectories import read_trajectories, turns


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("views")
    a = write_synthetic_run(root / "a", steps=4, samples_per_step=16, agentic=True, seed=0)
    b = write_synthetic_run(root / "b", steps=3, samples_per_step=16, agentic=True, seed=1, total_steps=6)
    with (b / "config.toml").open("a") as fh:
        fh.write("\n[train]\nlr = 0.0003\n")
    return [a, b]


@pytest.fixture(scope="module")
def server(runs):
    with BackgroundServer(runs) as srv:
        yield srv


def _open(browser, url: str, tab: str):
    page = browser.new_page(viewport={"width": 1300, "height": 900}, accept_downloads=True)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url + "#" + tab)
    page.wait_for_selector("body[data-ready='1']")
    return page, errors


def _show_samples(page, step: int) -> None:
    page.select_option("#samples-step", str(step))
    page.wait_for_selector(f"body[data-samples-step='{step}']")


@pytest.mark.timeout(120)
def test_trajectory_viewer_shows_the_recorded_tokens_masks_and_segments(browser, server, runs):
    recorded = {t["sample_index"]: t for t in read_trajectories(runs[0], step=3)}
    failed = [s for s in _lines(runs[0] / "samples.jsonl") if s["step"] == 3 and s["status"] == "failed"]
    assert recorded and all(s["sample_index"] in recorded for s in failed)  # every failure recorded
    page, errors = _open(browser, server.url, "samples")
    _show_samples(page, 3)
    shown = page.eval_on_selector_all(
        "#samples-table tbody tr",
        "rs => rs.map(r => [+r.dataset.sample, !!r.querySelector('.open-trajectory')])",
    )
    assert {i for i, has in shown if has} == set(recorded)
    for index in sorted(recorded)[:2] + [f["sample_index"] for f in failed[:1]]:
        t = recorded[index]
        page.click(f"#samples-table button.open-trajectory[data-sample='{index}']")
        page.wait_for_selector(f"body[data-trajectory='3/train/{index}']")
        ids = page.eval_on_selector_all(
            "#trajectory-view .seg:not(.seg-prompt) .tok", "ts => ts.map(t => +t.dataset.id)"
        )
        masks = page.eval_on_selector_all(
            "#trajectory-view .seg:not(.seg-prompt) .tok", "ts => ts.map(t => +t.dataset.mask)"
        )
        prompt = page.eval_on_selector_all(
            "#trajectory-view .seg-prompt .tok", "ts => ts.map(t => +t.dataset.id)"
        )
        assert prompt == t["tokens"][: t["prompt_length"]]
        assert ids == t["tokens"][t["prompt_length"] :] and masks == t["loss_mask"]
        shaded = page.eval_on_selector_all("#trajectory-view .tok.masked", "ts => ts.map(t => +t.dataset.i)")
        assert shaded == [i for i, m in enumerate(t["loss_mask"]) if m == 0] and shaded  # the observation
        segs = page.eval_on_selector_all(
            "#trajectory-view .seg[data-source]",
            "ss => ss.map(s => [s.dataset.source, +s.dataset.start, +s.dataset.length, s.innerText])",
        )
        assert [(s, a, n) for s, a, n, _ in segs] == [
            (g["source"], g["start"], g["length"]) for g in t["segments"]
        ]
        for (_, _, _, text), part in zip(segs, turns(t), strict=True):
            assert part["text"].replace("\n", "⏎\n") in text
        assert "tool call" in segs[0][3] and "observation" in segs[1][3]
        tip = page.get_attribute("#trajectory-view .seg[data-seg='0'] .tok[data-i='1']", "title")
        assert f"engine log-prob {t['rollout_logprobs'][1]:.4f}" in tip
        assert f"trainer log-prob {t['trainer_logprobs'][1]:.4f}" in tip
        mismatch = abs(t["trainer_logprobs"][1] - t["rollout_logprobs"][1])
        assert f"mismatch {mismatch:.4f}" in tip and f"weight version {t['token_versions'][1]}" in tip
        if t["advantages"] is not None:
            assert f"advantage {t['advantages'][1]:.4f}" in tip
    page.select_option("#token-color", "advantage")
    page.wait_for_selector("#trajectory-view")
    assert errors == []
    page.close()


@pytest.mark.timeout(120)
def test_comparison_table_equals_the_runs_files(browser, server, runs):
    page, errors = _open(browser, server.url, "compare")
    page.wait_for_selector("body[data-compare='2']")

    def cells(key: str) -> list[str]:
        return page.eval_on_selector_all(
            f"#compare-table tr[data-key='{key}'] td[data-run]", "ts => ts.map(t => t.dataset.value)"
        )

    assert page.eval_on_selector_all("#compare-table tr.diff", "rs => rs.map(r => r.dataset.key)") == [
        "run.name", "run.num_steps", "train.lr",
    ]  # fmt: skip
    assert cells("run.num_steps") == ["4", "6"] and cells("train.lr") == ["", "0.0003"]
    metrics = [_lines(r / "metrics.jsonl") for r in runs]
    finals = cells("rollout/reward_mean · final")
    assert [float(v) for v in finals] == [m[-1]["rollout/reward_mean"] for m in metrics]
    best = cells("rollout/reward_mean · best (step)")
    for text, rows in zip(best, metrics, strict=True):
        top = max(rows, key=lambda m: m["rollout/reward_mean"])
        value, step = text.split()
        assert (
            float(value) == pytest.approx(top["rollout/reward_mean"], rel=1e-3) and step == f"({top['step']})"
        )
    assert cells("steps") == ["4 / 4", "3 / 6"]
    assert cells("wall time") == ["3s", "2s"]  # first to last metrics row (no started_at here)
    page.check("#compare-all")
    page.wait_for_selector("#compare-table tr[data-key='rollout.n_samples_per_prompt']")
    assert cells("rollout.n_samples_per_prompt") == ["8", "8"]
    assert errors == []
    page.close()


def _expected_order(rows: list[dict], key, desc: bool) -> list[int]:
    present = [r for r in rows if key(r) is not None]
    present.sort(key=lambda r: (key(r), r["sample_index"]), reverse=desc)
    return [r["sample_index"] for r in present] + [r["sample_index"] for r in rows if key(r) is None]


def _reward(r: dict) -> float | None:
    v = r["reward"]
    return float(v["score"]) if isinstance(v, dict) else v


def _check_sort_and_filter(page, rows: list[dict]) -> None:
    def order() -> list[int]:
        return page.eval_on_selector_all("#samples-table tbody tr", "rs => rs.map(r => +r.dataset.sample)")

    def wait_query(fragment: str) -> None:
        page.wait_for_function(f"(document.body.dataset.samplesQuery || '').includes({json.dumps(fragment)})")

    page.click("#samples-table th[data-sort='reward']")
    wait_query('"sort":"reward","desc":"0"')
    assert order() == _expected_order(rows, _reward, False)
    page.click("#samples-table th[data-sort='reward']")
    wait_query('"sort":"reward","desc":"1"')
    assert order() == _expected_order(rows, _reward, True)
    page.click("#samples-table th[data-sort='advantage']")
    wait_query('"sort":"advantage","desc":"0"')
    assert order() == _expected_order(rows, lambda r: r["advantage"], False)
    page.check("#samples-status-filter input[data-status='completed']")
    wait_query('"status":"completed"')
    want = [r for r in rows if r["status"] == "completed"]
    assert order() == _expected_order(want, lambda r: r["advantage"], False)
    page.fill("#reward-min", "0.3")
    page.fill("#reward-max", "0.6")
    wait_query('"reward_max":"0.6"')
    want = [r for r in want if 0.3 <= _reward(r) <= 0.6]
    assert order() == _expected_order(want, lambda r: r["advantage"], False) and want
    assert page.get_attribute("#samples-count", "data-total") == str(len(want))


@pytest.mark.timeout(120)
def test_samples_sort_and_filter_return_the_right_rows(browser, server, runs, tmp_path):
    rows = [r for r in _lines(runs[0] / "samples.jsonl") if r["step"] == 2]
    assert {r["status"] for r in rows} > {"completed"}  # there is something to filter out
    page, errors = _open(browser, server.url, "samples")
    _show_samples(page, 2)
    _check_sort_and_filter(page, rows)
    assert errors == []
    page.close()
    out = tmp_path / "report.html"  # the report applies the same rules to its embedded rows
    assert main(["report", str(runs[0]), "-o", str(out)]) == 0
    page, errors = _open(browser, out.as_uri(), "samples")
    _show_samples(page, 2)
    _check_sort_and_filter(page, rows)
    page.click("#samples-table button.open-trajectory >> nth=0")  # trajectories travel in the report
    page.wait_for_selector("body[data-trajectory]")
    assert errors == []
    page.close()


@pytest.mark.timeout(120)
def test_curve_panels_group_by_prefix_and_export_the_data(browser, server, runs):
    page, errors = _open(browser, server.url, "curves")
    page.wait_for_function("document.body.dataset.curves === 'rollout/reward_mean'")
    groups = page.eval_on_selector_all(
        "#curve-panels details.panel", "ds => ds.map(d => [d.dataset.group, d.open])"
    )
    assert groups == [["rollout", True], ["time", False], ["train", False]]
    page.click("#curve-panels details[data-group='time'] > summary")
    page.wait_for_function("document.body.dataset.curves.split(',').length === 5")
    chart = "document.querySelector(\"[data-key='curve-time/step_s']\")"
    assert page.evaluate(f"{chart}.layout.hovermode") == "x unified"
    assert page.evaluate(f"{chart}.data.map(t => t.name)") == ["a", "b"]  # every run, one hover
    axis = page.evaluate(
        f"{chart}._fullLayout.xaxis.tickvals || {chart}._fullLayout.xaxis._vals.map(v => v.x)"
    )
    assert axis and all(float(v).is_integer() for v in axis)  # no 0.5 step ticks
    with page.expect_download() as got:
        page.click("#curve-panels .chart-card[data-metric='rollout/reward_mean'] .export-csv")
    table = list(csv.DictReader(io.StringIO(Path(got.value.path()).read_text())))
    want = [
        (name, m["step"], m["time"], m["rollout/reward_mean"])
        for name, run in zip("ab", runs, strict=True)
        for m in _lines(run / "metrics.jsonl")
    ]
    assert [(r["run"], int(r["step"]), float(r["wall_time"]), float(r["value"])) for r in table] == want
    with page.expect_download() as got:
        page.click("#curve-panels .chart-card[data-metric='rollout/reward_mean'] .export-png")
    png = Path(got.value.path()).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    reward = "document.querySelector(\"[data-key='curve-rollout/reward_mean']\")"
    page.select_option("#curve-x", "relative")
    page.wait_for_function(f"{reward}.layout.xaxis.title.text.startsWith('seconds')")
    rows = _lines(runs[0] / "metrics.jsonl")  # no started_at in status.json: from the first row
    assert page.evaluate(f"{reward}.data[0].x") == [m["time"] - rows[0]["time"] for m in rows]
    page.check("#curve-log")
    page.wait_for_function(f"{reward}.layout.yaxis.type === 'log'")
    assert errors == []
    page.close()
