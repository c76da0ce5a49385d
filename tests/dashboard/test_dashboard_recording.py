"""What a run records for the dashboard: bounded `samples.jsonl` lines, `status.json` through a
run's life, and the buffered sink that carries the Ray rollout manager's events to the driver."""

from __future__ import annotations

import json
import time

from verst.rollout.lifecycle import EventKind, LifecycleEvent
from verst.rollout.protocols import RolloutResult
from verst.rollout.sample import Sample, Status
from verst.trainer.run import recording
from verst.trainer.run.recording import BufferedSink, RunRecorder


def _sample(i: int, **kw) -> Sample:
    base = dict(
        prompt="p",
        tokens=[1, 2, 3],
        response_length=1,
        response="r",
        reward=0.5,
        status=Status.COMPLETED,
        weight_versions=[3],
        group_index=i // 2,
        sample_index=i,
    )
    base.update(kw)
    return Sample(**base)


def test_sample_lines_are_bounded_whatever_the_sample(tmp_path):
    huge = "x" * 200_000 + "\n" + "y" * 100_000
    samples = [
        _sample(
            0,
            response=huge,
            prompt=[{"role": "user", "content": "q" * 50_000}],
            reward={f"k{i}": float(i) for i in range(500)},
            weight_versions=list(range(100)),
            metadata={"error": "generate: RuntimeError: " + "e" * 10_000, "attempt": 2},
            status=Status.FAILED,
            label="l" * 9_999,
        ),
        _sample(1, reward=float("nan")),
    ]
    rec = RunRecorder(tmp_path, total_steps=4)
    rec.record_rollout(0, RolloutResult(groups=[samples]))
    rec.close()
    lines = (tmp_path / recording.SAMPLES_FILE).read_text().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert len(lines[0]) < 8_000
    assert first["step"] == 1 and first["rollout_id"] == 0 and first["split"] == "train"
    assert len(first["response"]) <= recording.RESPONSE_PREVIEW + 48 and first["response"].startswith("xxx")
    assert first["response"].endswith("yyy") and "chars omitted" in first["response"]
    assert first["prompt"].startswith("user: qqq") and len(first["prompt"]) <= recording.PROMPT_PREVIEW + 48
    assert len(first["reward"]) == recording.MAX_REWARD_KEYS and first["reward"]["k3"] == 3.0
    assert first["weight_versions"] == list(range(84, 100))
    assert first["status"] == "failed" and first["error"].startswith("generate: RuntimeError")
    assert len(first["error"]) <= recording.TEXT_PREVIEW + 48 and first["attempt"] == 2
    assert second["reward"] is None  # NaN is not JSON


def test_samples_per_step_are_capped_and_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(recording, "MAX_SAMPLES_PER_STEP", 5)
    rec = RunRecorder(tmp_path, total_steps=2)
    rec.record_rollout(0, RolloutResult(groups=[[_sample(i) for i in range(8)]]))
    rec.record_eval(1, RolloutResult(eval={"heldout": [[_sample(i) for i in range(3)]]}))
    rec.close()
    rows = [json.loads(x) for x in (tmp_path / recording.SAMPLES_FILE).read_text().splitlines()]
    assert [(r["step"], r["split"]) for r in rows] == [(1, "train")] * 5 + [(1, "eval/heldout")] * 3
    assert rec.samples_written == 8 and rec.samples_dropped == 3


def _status(tmp_path):
    return json.loads((tmp_path / recording.STATUS_FILE).read_text())


def _eventually(tmp_path, done, timeout_s: float = 10.0):
    """The status once `done(status)` holds (it is written by a background thread)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status = _status(tmp_path)
        except (FileNotFoundError, json.JSONDecodeError):
            status = None
        if status is not None and done(status):
            return status
        assert time.monotonic() < deadline, f"status.json never got there: {status}"
        time.sleep(0.01)


def test_status_through_a_run(tmp_path):
    rec = RunRecorder(tmp_path, total_steps=3)
    assert _status(tmp_path)["state"] == "running" and _status(tmp_path)["step"] == 0
    rec.resumed_at(1)
    for name in ("eval", "rollout", "train", "sync"):
        rec.phase(name)
    rec.step_done(2)
    status = _eventually(tmp_path, lambda s: s["step"] == 2)
    assert status["state"] == "running" and status["phase"] == "sync" and status["step"] == 2
    assert set(status["phase_seconds"]) == {"eval", "rollout", "train", "sync"}
    assert status["eta_s"] is not None and status["eta_s"] >= 0
    assert status["pid"] > 0 and status["host"]
    rec.finish(stopped_early=False)
    assert _status(tmp_path)["state"] == "finished" and _status(tmp_path)["eta_s"] is None

    rec2 = RunRecorder(tmp_path / "b", total_steps=3)
    rec2.fail(RuntimeError("CUDA out of memory"))
    assert _status(tmp_path / "b")["state"] == "failed"
    assert _status(tmp_path / "b")["error"] == "RuntimeError: CUDA out of memory"
    rec3 = RunRecorder(tmp_path / "c", total_steps=3)
    rec3.fail(KeyboardInterrupt())
    assert _status(tmp_path / "c")["state"] == "stopped_early"
    assert not list(tmp_path.glob(".status.json.*"))  # written atomically, no temp file left


def test_status_changes_are_batched_and_the_latest_always_lands(tmp_path, monkeypatch):
    """Phase changes and finished steps reach status.json off the training thread, at most once
    per interval, and always the latest; the run's end is written at once (never overtaken by
    an older background write)."""
    rec = RunRecorder(tmp_path, total_steps=1000, status_interval_s=0.3)
    path = tmp_path / recording.STATUS_FILE
    writes = []
    real_replace = recording.os.replace

    def counted(src, dst):  # the real rename, counted
        writes.append(dst)
        return real_replace(src, dst)

    monkeypatch.setattr(recording.os, "replace", counted)
    start = time.monotonic()
    for step in range(1, 201):  # 600 phase changes and 200 steps in well under a second
        for name in ("rollout", "train", "sync"):
            rec.phase(name)
        rec.step_done(step)
    spent = time.monotonic() - start
    status = _eventually(tmp_path, lambda s: s["step"] == 200)
    assert status["phase"] == "sync" and status["state"] == "running"
    assert len(writes) <= 2 + spent / 0.3 + 2  # not one per change
    rec.phase("rollout")  # a long phase after short ones still shows up
    assert _eventually(tmp_path, lambda s: s["phase"] == "rollout")["step"] == 200
    rec.finish(stopped_early=False)
    assert _status(tmp_path)["state"] == "finished"  # at once, on this thread
    rec.close()
    assert _status(tmp_path)["state"] == "finished" and path.exists()
    assert not list(tmp_path.glob(".status.json.*"))


def test_buffered_sink_drains_in_order_and_bounds_memory():
    sink = BufferedSink(maxlen=3)
    events = [LifecycleEvent(EventKind.ATTEMPT_START, 0, 0, i, 0, {"attempt": 0}) for i in range(5)]
    for e in events[:2]:
        sink.emit(e)
    assert sink.drain() == events[:2] and sink.drain() == []
    for e in events:
        sink.emit(e)
    assert sink.drain() == events[2:] and sink.dropped == 2


def _episode(i: int, status: Status = Status.COMPLETED, **kw) -> Sample:
    """A two-turn episode built the way agentic rollouts build them (`append_turn`)."""
    from verst.rollout.agentic.trajectory import append_turn

    s = Sample(prompt=f"q{i}", tokens=[5, 6, 7], status=status, group_index=i // 4, sample_index=i, **kw)
    append_turn(s, [10, 11], [-0.5, -0.25], True, 2, text="<call>")
    append_turn(s, [20, 21, 22], None, False, text="<obs>")
    append_turn(s, [12, 13], [-1.0, -2.0], True, 3, text="done")
    return s


def test_full_trajectories_for_a_bounded_choice_and_every_failure(tmp_path):
    from verst.trainer.dashboard.trajectories import read_trajectories, turns
    from verst.trainer.run.trajectories import StepDetail, TokenDetail

    statuses = {1: Status.FAILED, 6: Status.ABORTED, 8: Status.FAILED}
    samples = [_episode(i, statuses.get(i, Status.COMPLETED), reward=float(i)) for i in range(10)]
    samples[0].reward = float("nan")
    detail = StepDetail(
        advantages={(0, 0): 0.5, (0, 2): -0.25},
        tokens={(0, 2): TokenDetail([0.1] * 7, [-0.4, -0.3, 0.0, 0.0, 0.0, -1.1, -2.2])},
    )
    rec = RunRecorder(
        tmp_path, total_steps=2, trajectories_per_step=3, decode=lambda ids: [f"<{i}>" for i in ids]
    )
    rec.record_rollout(0, RolloutResult(groups=[samples[:4], samples[4:8], samples[8:]]), detail)
    rec.record_eval(1, RolloutResult(eval={"heldout": [[_episode(0)]]}))
    rec.close()
    got = {(t["split"], t["sample_index"]): t for t in read_trajectories(tmp_path)}
    assert {k: t["reason"] for k, t in got.items()} == {
        ("train", 0): "sampled", ("train", 2): "sampled", ("train", 3): "sampled",  # 3 lowest others
        ("train", 1): "failed", ("train", 6): "aborted", ("train", 8): "failed",  # every failure
        ("eval/heldout", 0): "sampled",
    }  # fmt: skip
    t = got[("train", 2)]
    s = samples[2]
    assert t["tokens"] == s.tokens and t["loss_mask"] == s.loss_mask == [1, 1, 0, 0, 0, 1, 1]
    assert t["rollout_logprobs"] == s.rollout_logprobs and t["token_versions"] == s.token_versions
    assert t["advantages"] == [0.1] * 7 and t["trainer_logprobs"][5] == -1.1
    assert t["token_text"] == [f"<{i}>" for i in s.tokens] and t["segments"] == s.metadata["segments"]
    assert [(p["source"], p["ids"], p["text"]) for p in turns(t)] == [
        ("model", [10, 11], "<10><11>"), ("env", [20, 21, 22], "<20><21><22>"), ("model", [12, 13], "<12><13>"),
    ]  # fmt: skip
    assert got[("train", 3)]["advantages"] is None and got[("train", 3)]["trainer_logprobs"] is None
    assert got[("train", 0)]["reward"] is None  # NaN is not JSON
    rows = {
        r["sample_index"]: r
        for r in map(json.loads, (tmp_path / recording.SAMPLES_FILE).read_text().splitlines())
        if r["split"] == "train"
    }
    assert rows[0]["advantage"] == 0.5 and rows[2]["advantage"] == -0.25 and rows[5]["advantage"] is None
    assert rec.trajectories_written == 7 and rec.status()["trajectories_written"] == 7


def test_trajectories_are_cut_at_max_tokens_and_carry_moe_routing(tmp_path):
    from verst.trainer.dashboard.trajectories import read_trajectories

    class Routing:  # the shape of verst.rollout.moe.RoutedExperts: [len(tokens) - 1 rows, width]
        width, tokens = 2, 9

        def to_ints(self):
            return [r * 10 + k for r in range(9) for k in range(2)]

    s = _episode(0)
    s.routed_experts = Routing()
    rec = RunRecorder(tmp_path, total_steps=1, max_tokens=8, trajectories_per_step=1)
    rec.record_rollout(0, RolloutResult(groups=[[s]]))
    rec.close()
    (t,) = read_trajectories(tmp_path)
    assert t["tokens"] == s.tokens[:8] and t["truncated_tokens"] == 2 and len(t["loss_mask"]) == 5
    # response token i is produced by the forward at position prompt_length - 1 + i
    assert t["routed_experts"] == {
        "width": 2,
        "per_token": [[20, 21], [30, 31], [40, 41], [50, 51], [60, 61]],
    }
    rec = RunRecorder(tmp_path / "none", total_steps=1, trajectories_per_step=0, failed_trajectories=False)
    rec.record_rollout(0, RolloutResult(groups=[[_episode(0, Status.FAILED)]]))
    rec.close()
    assert list(read_trajectories(tmp_path / "none")) == []


def test_lazy_decoder_decodes_each_id_once_and_matches_the_tokenizer():
    """The decoder remembers each id's text: the same texts as the tokenizer's own per-id
    `batch_decode`, and the tokenizer is asked only about ids it has not seen."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from verst.rollout.toy import build_char_tokenizer
    from verst.trainer.run.recording import lazy_decoder

    tok = build_char_tokenizer()
    asked: list[list[list[int]]] = []
    real_batch_decode = tok.batch_decode

    def counted(ids, **kw):  # the real tokenizer, its calls recorded
        asked.append(ids)
        return real_batch_decode(ids, **kw)

    tok.batch_decode = counted
    loads = []
    decode = lazy_decoder(lambda: loads.append(1) or tok)
    vocab = len(tok)

    @settings(max_examples=50, deadline=None)
    @given(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40))  # never called empty
    def check(ids):
        want = real_batch_decode([[i] for i in ids], clean_up_tokenization_spaces=False)
        before = {i for call in asked for [i] in call}
        assert decode(ids) == want
        new = [i for call in asked for [i] in call]
        assert len(new) == len(set(new))  # no id decoded twice, ever
        assert set(new) - before <= set(ids)

    check()
    assert loads == [1]  # the tokenizer was loaded once
