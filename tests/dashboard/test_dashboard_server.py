"""The dashboard server's JSON views, its file serving (path traversal), and reading run files that
are malformed, truncated or still being written — against a real aiohttp server on 127.0.0.1.

Run directories are synthetic (`verst.trainer.dashboard.synthetic`, which writes through the
run's own writers) or hand-written lines where a test needs a specific fault.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.trainer.dashboard.run_data import RunData
from verst.trainer.dashboard.server import DEFAULT_HOST, load_runs, start_server
from verst.trainer.dashboard.synthetic import write_synthetic_run
from verst.trainer.dashboard.tail import JsonlTail


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _attempts_in_file(run: Path, rollout_id: int) -> set[tuple]:
    return {
        (e["group_index"], e["sample_index"], e["detail"].get("attempt", 0))
        for e in _lines(run / "lifecycle.jsonl")
        if e["rollout_id"] == rollout_id
    }


class Client:
    """GETs against a running dashboard server."""

    def __init__(self, session: aiohttp.ClientSession, port: int) -> None:
        self.session, self.base = session, f"http://127.0.0.1:{port}"

    async def get(self, path: str, **params) -> tuple[int, object]:
        async with self.session.get(self.base + path, params=params or None) as resp:
            body = await resp.read()
            ctype = resp.headers.get("Content-Type", "")
            return resp.status, (json.loads(body) if "json" in ctype else body)


@pytest.fixture()
async def serve():
    runners = []
    session = aiohttp.ClientSession()

    async def start(*dirs: Path) -> Client:
        runner, port = await start_server(load_runs(dirs), port=0)
        runners.append(runner)
        return Client(session, port)

    yield start
    await session.close()
    for runner in runners:
        await runner.cleanup()


@pytest.fixture(scope="module")
def agentic_run(tmp_path_factory) -> Path:
    return write_synthetic_run(
        tmp_path_factory.mktemp("runs") / "agentic",
        steps=3,
        samples_per_step=24,
        agentic=True,
        retry_every=5,
        unfinished_every=11,
    )


async def test_json_views_match_the_files(serve, agentic_run):
    client = await serve(agentic_run)
    status, runs = await client.get("/api/runs")
    assert status == 200
    assert runs == [{"id": 0, "name": "agentic", "folder": "agentic", "path": str(agentic_run.resolve())}]

    _, overview = await client.get("/api/runs/0/overview")
    assert overview["status"]["state"] == "finished" and overview["status"]["step"] == 3
    assert overview["status"]["total_steps"] == 3
    assert overview["n_events"] == len(_lines(agentic_run / "lifecycle.jsonl"))
    assert overview["n_samples"] == len(_lines(agentic_run / "samples.jsonl"))
    assert overview["status"]["phase_seconds"]["rollout"] == pytest.approx(1.8)

    _, steps = await client.get("/api/runs/0/steps")
    assert [r["step"] for r in steps["timeline_steps"]] == [1, 2, 3] and steps["sample_steps"] == [1, 2, 3]

    _, tl = await client.get("/api/runs/0/timeline", step=2)
    expected = _attempts_in_file(agentic_run, rollout_id=1)
    assert tl["total"] == len(expected) == len(tl["rows"])
    assert {(r["group"], r["sample"], r["attempt"]) for r in tl["rows"]} == expected
    assert steps["timeline_steps"][1]["attempts"] == len(expected)
    rows = {(r["sample"], r["attempt"]): r for r in tl["rows"]}
    # a retried sample: the failed first attempt is linked from its retry
    first, retry = rows[(5, 0)], rows[(5, 1)]
    assert first["status"] == "failed" and first["error"] == "RuntimeError"
    assert tl["rows"][retry["retry_of"]] == first
    # an attempt without attempt_end is unfinished (the run is over), not dropped
    assert rows[(11, 0)]["status"] == "unfinished" and not rows[(11, 0)]["finished"]
    # spans are ordered: start <= queued end <= generation <= scoring <= end
    for r in tl["rows"]:
        assert r["start"] <= r["queued_end"] <= r["gen"][0][0] <= r["gen"][-1][1] <= r["end"]
    # agentic sub-spans: two turns and two tool calls per attempt, durations from the events
    sub = rows[(0, 0)]["sub"]
    assert Counter(s["kind"] for s in sub) == {"turn": 2, "tool": 2}
    tool = next(s for s in sub if s["kind"] == "tool")
    assert tool["name"] == "tool calc"
    assert tool["end"] - tool["start"] == pytest.approx(tool["detail"]["duration_s"], abs=1e-3)
    assert all(r["start"] <= s["start"] <= s["end"] <= r["end"] for r in tl["rows"] for s in r["sub"])

    _, page = await client.get("/api/runs/0/samples", step=2, limit=10, offset=20)
    assert page["total"] == 24 and len(page["items"]) == 4
    file_rows = [r for r in _lines(agentic_run / "samples.jsonl") if r["step"] == 2]
    assert [{k: v for k, v in r.items() if k != "has_trajectory"} for r in page["items"]] == file_rows[20:24]
    _, hits = await client.get("/api/runs/0/samples", step=2, q="ANSWER IS 13")
    assert [h["sample_index"] for h in hits["items"]] == [12]
    _, dict_reward = await client.get("/api/runs/0/samples", step=1, q='"format"')
    assert dict_reward["total"] > 0 and all(isinstance(r["reward"], dict) for r in dict_reward["items"])

    _, curves = await client.get("/api/runs/0/curves", names="rollout/reward_mean,nope")
    assert list(curves["series"]) == ["rollout/reward_mean"] and curves["series"]["rollout/reward_mean"][
        "x"
    ] == [1, 2, 3]
    assert "train/loss" in curves["metrics"]


async def test_page_assets_and_errors(serve, agentic_run):
    client = await serve(agentic_run)
    status, html = await client.get("/")
    assert status == 200 and b"static/app.js" in html and b"//cdn" not in html
    for name in ("app.js", "style.css", "plotly.min.js"):
        status, body = await client.get(f"/static/{name}")
        assert status == 200 and len(body) > 1000
    assert (await client.get("/api/runs/7/overview"))[0] == 404
    assert (await client.get("/api/runs/x/overview"))[0] == 404
    assert (await client.get("/api/runs/0/timeline"))[0] == 400  # step is required
    assert (await client.get("/api/runs/0/timeline", step="two"))[0] == 400
    async with client.session.post(client.base + "/api/runs") as resp:
        assert resp.status == 405  # read-only
    _, empty = await client.get("/api/runs/0/timeline", step=99)
    assert empty["total"] == 0 and empty["rows"] == []


async def test_path_traversal_is_refused(serve, agentic_run, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not serve")
    link = agentic_run / "escape.txt"
    if not link.exists():
        os.symlink(secret, link)
    client = await serve(agentic_run)
    status, body = await client.get("/runs/0/files/config.toml")
    assert status == 200 and body == (agentic_run / "config.toml").read_bytes()
    rel = os.path.relpath(secret, agentic_run)
    attempts = [
        f"/runs/0/files/{rel.replace('/', '%2F')}",
        "/runs/0/files/..%2F..%2F..%2F..%2Fetc%2Fpasswd",
        "/runs/0/files/%2Fetc%2Fpasswd",
        "/runs/0/files/escape.txt",  # a symlink out of the run directory
        "/static/..%2Fserver.py",
        "/static/%2E%2E%2F%2E%2E%2Fcli.py",
        "/runs/0/files/../../../../etc/passwd",
    ]
    for path in attempts:
        async with client.session.get(client.base + path) as resp:
            body = await resp.read()
            assert 400 <= resp.status < 500, (path, resp.status)
            assert b"do not serve" not in body and b"root:" not in body


def test_runs_are_labelled_by_run_name(tmp_path):
    run = write_synthetic_run(tmp_path / "folder-7", steps=2, samples_per_step=4)
    text = (run / "config.toml").read_text().replace('name = "folder-7"', 'name = "grpo lr=3e-4"')
    (run / "config.toml").write_text(text)
    data = RunData(run, run_id=0)
    assert data.name == "grpo lr=3e-4" and data.overview()["name"] == "grpo lr=3e-4"
    (run / "config.toml").write_text("[run]\nnum_steps = 2\n")  # no run.name: the folder
    data.refresh(force=True)
    assert data.name == "folder-7"


def test_default_bind_is_loopback():
    assert DEFAULT_HOST == "127.0.0.1"
    from verst.trainer.cli import build_parser

    args = build_parser().parse_args(["dashboard", "runs/x"])
    assert args.host == "127.0.0.1"


def test_malformed_and_truncated_lines_are_skipped_and_counted(tmp_path):
    run = write_synthetic_run(tmp_path / "bad", steps=2, samples_per_step=8)
    good = (run / "lifecycle.jsonl").read_text().splitlines()
    expected = len(_attempts_in_file(run, 0))
    bad = [
        "this is not json",
        '{"kind": "attempt_end", "timestamp": 1800000000.5, "rollout_id": 0, "group_ind',  # truncated mid-write
        "[1, 2, 3]",
        '{"kind": 5, "timestamp": "x", "rollout_id": 0}',  # parses, but not an event
        "",
    ]
    lines = good[:5] + bad + good[5:]
    (run / "lifecycle.jsonl").write_text("\n".join(lines) + "\n" + good[0][:30])  # and a partial last line
    (run / "metrics.jsonl").open("a").write('{"step": \n{"no_step": 1}\n')
    data = RunData(run, run_id=0)
    data.refresh(force=True)
    assert data.timeline(1)["total"] == expected
    assert data.steps(budget_s=None)["timeline_steps"][0]["attempts"] == expected
    files = {f["file"]: f for f in data.overview()["files"]}
    assert files["lifecycle.jsonl"]["malformed"] == 4
    assert files["lifecycle.jsonl"]["partial_last_line"] is True
    assert files["lifecycle.jsonl"]["lines"] == len(lines)
    assert files["metrics.jsonl"]["malformed"] == 2
    assert [m["step"] for m in data.metrics] == [1, 2]


def test_a_run_directory_still_being_written(tmp_path):
    src = write_synthetic_run(tmp_path / "src", steps=3, samples_per_step=8, state="running", total_steps=5)
    run = tmp_path / "live"
    run.mkdir()
    data = RunData(run, run_id=0)
    data.refresh(force=True)  # nothing written yet
    overview = data.overview()
    assert overview["n_events"] == 0 and overview["status"]["step"] == 0
    assert data.steps()["timeline_steps"] == [] and data.timeline(1)["total"] == 0
    assert data.samples(1)["total"] == 0

    events = (src / "lifecycle.jsonl").read_bytes()
    samples = (src / "samples.jsonl").read_bytes()
    (run / "config.toml").write_bytes((src / "config.toml").read_bytes())
    (run / "status.json").write_bytes((src / "status.json").read_bytes())
    third = len(events) // 3
    cut = third + 17  # mid-line
    with (run / "lifecycle.jsonl").open("wb") as fh:
        fh.write(events[:cut])
        fh.flush()
        data.refresh(force=True)
        n1 = data.n_events
        assert n1 == events[:cut].count(b"\n") and data.events_tail.partial
        fh.write(events[cut:])
    (run / "samples.jsonl").write_bytes(samples[: len(samples) // 2 + 5])
    data.refresh(force=True)
    assert data.n_events == events.count(b"\n") > n1
    assert data.overview()["files"][1]["malformed"] == 0  # the split line was read whole, once
    assert data.overview()["status"]["state"] == "running" and data.overview()["status"]["total_steps"] == 5
    for step in (1, 2, 3):
        assert data.timeline(step)["total"] == len(_attempts_in_file(src, step - 1))
    with (run / "samples.jsonl").open("ab") as fh:
        fh.write(samples[len(samples) // 2 + 5 :])
    data.refresh(force=True)
    assert data.n_samples == samples.count(b"\n") == 24
    got = [{k: v for k, v in r.items() if k != "has_trajectory"} for r in data.samples(3)["items"]]
    assert got == [r for r in _lines(src / "samples.jsonl") if r["step"] == 3]


@settings(max_examples=40, deadline=None)
@given(
    records=st.lists(
        st.dictionaries(st.sampled_from("abc"), st.integers() | st.text(max_size=5)), max_size=12
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6),
)
def test_tail_reads_each_complete_line_once_whatever_the_write_boundaries(tmp_path_factory, records, cuts):
    """Appending a JSONL file in arbitrary pieces, reading after each: every record exactly once."""
    path = tmp_path_factory.mktemp("tail") / "x.jsonl"
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    tail, got = JsonlTail(path), []
    path.write_bytes(b"")
    points = sorted({min(c, len(data)) for c in cuts} | {len(data)})
    done = 0
    for point in points:
        with path.open("ab") as fh:
            fh.write(data[done:point])
        done = point
        got.extend(tail.records())
    assert got == records and tail.malformed == 0 and not tail.partial


def test_cli_serves_the_given_runs_and_refuses_missing_ones(agentic_run, tmp_path, capsys):
    import subprocess
    import sys
    import urllib.request

    from verst.trainer.cli import main

    assert main(["dashboard", str(tmp_path / "nope")]) == 2
    assert "not a run directory" in capsys.readouterr().err
    proc = subprocess.Popen(
        [sys.executable, "-m", "verst.trainer.cli", "dashboard", str(agentic_run), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("verst dashboard: http://127.0.0.1:"), line
        url = line.split()[2]
        with urllib.request.urlopen(url + "api/runs/0/overview", timeout=30) as resp:
            assert json.loads(resp.read())["status"]["step"] == 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def test_a_nul_byte_in_a_file_path_is_a_client_error(serve, agentic_run):
    client = await serve(agentic_run)
    for path in ("/runs/0/files/a%00b", "/runs/0/files/config.toml%00.png", "/runs/0/files/%00"):
        async with client.session.get(client.base + path) as resp:
            assert resp.status == 400, (path, resp.status)
            assert "NUL" in await resp.text()


def test_a_busy_port_names_the_port_option_and_the_default_is_not_rays(agentic_run, capsys):
    import socket

    from verst.rollout.errors import ConfigError
    from verst.trainer.cli import build_parser, main
    from verst.trainer.dashboard.server import DEFAULT_PORT, BackgroundServer

    assert DEFAULT_PORT not in (8265, 6006, 8888)  # Ray's dashboard, TensorBoard, Jupyter
    assert build_parser().parse_args(["dashboard", "runs/x"]).port == DEFAULT_PORT
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as err:
            BackgroundServer([agentic_run], port=port)
        assert err.value.problems[0].key == "--port" and "already in use" in str(err.value)
        assert main(["dashboard", str(agentic_run), "--port", str(port)]) == 2
    out = capsys.readouterr().err
    assert "--port" in out and f"port {port} on 127.0.0.1 is already in use" in out and "Traceback" not in out


async def test_beyond_loopback_every_request_needs_the_token(agentic_run):
    from verst.trainer.dashboard.auth import COOKIE, is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4")
    runner, port = await start_server(load_runs([agentic_run]), port=0, token="s3cret")
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:  # an IP host
            for path in (
                "/",
                "/api/runs",
                "/api/runs/0/overview",
                "/static/app.js",
                "/runs/0/files/config.toml",
            ):
                async with session.get(base + path) as resp:
                    assert resp.status == 401, path
                async with session.get(base + path, params={"token": "wrong"}) as resp:
                    assert resp.status == 401, path
            async with session.get(base + "/api/runs", headers={"Authorization": "Bearer s3cret"}) as resp:
                assert resp.status == 200
            async with session.get(base + "/", params={"token": "s3cret"}) as resp:
                assert resp.status == 200 and COOKIE in resp.cookies
            async with session.get(base + "/api/runs/0/overview") as resp:  # the page's own requests
                assert resp.status == 200
    finally:
        await runner.cleanup()


def test_cli_beyond_loopback_warns_and_prints_a_token_url(agentic_run):
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "verst.trainer.cli",
            "dashboard",
            str(agentic_run),
            "--host",
            "0.0.0.0",
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "?token=" in line, line
        url = line.split()[2].replace("0.0.0.0", "127.0.0.1")
        token = url.split("?token=")[1]
        assert len(token) >= 20
        bare = url.split("?")[0]
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(bare + "api/runs", timeout=30)
        assert refused.value.code == 401
        with urllib.request.urlopen(bare + "api/runs?token=" + token, timeout=30) as resp:
            assert json.loads(resp.read())[0]["id"] == 0
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "has no login" in err and "0.0.0.0" in err
