"""`RunData`: one run directory read incrementally, with the views the dashboard serves.

`refresh()` reads only what the run's files gained since the last call (`JsonlTail`), so a
live run costs little per poll and a finished one is read once. Neither events nor samples
are parsed up front: the reader indexes each line's byte offset by rollout (lifecycle, from the
`"rollout_id": N` near the line's head) or by step and split (samples) and parses one step's
lines when that step is asked for (a few steps' attempts are kept). Per-step summaries (the
queue vs generation chart) are computed within a time budget per request and completed by the
following polls, so a 200k-event run opens in about the time one step takes to parse.

Steps: the rollout with `rollout_id = r` trains step `r + 1`, the step `metrics.jsonl` logs.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
import tomllib
from collections import OrderedDict
from pathlib import Path
from typing import Any

from verst.trainer.dashboard.compare import flatten
from verst.trainer.dashboard.samples_view import SampleQuery, query_samples, scalar_reward
from verst.trainer.dashboard.status_view import (
    CONFIG_SUMMARY_KEYS,
    last_rewards,
    metric_phases,
    pid_alive,
    wall_seconds,
)
from verst.trainer.dashboard.tail import JsonlTail, head_int
from verst.trainer.dashboard.timeline import (
    Attempt,
    Event,
    build_attempts,
    event_from_record,
    step_rows,
    summarize,
)
from verst.trainer.dashboard.trajectories import TrajectoryIndex

REFRESH_MIN_INTERVAL_S = 0.5
"""Polls closer together than this reuse the last read."""
MAX_CURVE_POINTS = 4000
"""Points per curve sent to the browser (longer series are strided)."""
STALE_AFTER_S = 600.0
"""A 'running' run on another host whose files have not changed for this long is shown as stale."""
_SAMPLE_HEAD = re.compile(rb'^\{"step": (-?\d+), "rollout_id": [^,]*, "split": "([^"\\]*)"')
_SAMPLE_CACHE_STEPS = 8
_ATTEMPT_CACHE_STEPS = 16
_ROLLOUT_KEY = b'"rollout_id": '
SUMMARY_BUDGET_S = 0.3
"""Seconds one `steps()` call may spend summarising steps not yet summarised."""


class RunData:
    """Everything the dashboard shows about one run directory."""

    def __init__(self, root: Path, *, run_id: int) -> None:
        self.root = root
        self.run_id = run_id
        self._lock = threading.Lock()
        self._last_refresh = 0.0
        self._live = False
        self._reset()
        self._read_config()

    @property
    def name(self) -> str:
        """`run.name` from the run's config, else the folder's name."""
        name = self.config.get("run", {}).get("name") if isinstance(self.config.get("run"), dict) else None
        return str(name) if name else self.root.name

    def _reset(self) -> None:
        self.metrics_tail = JsonlTail(self.root / "metrics.jsonl")
        self.events_tail = JsonlTail(self.root / "lifecycle.jsonl")
        self.samples_tail = JsonlTail(self.root / "samples.jsonl")
        self.trajectories = TrajectoryIndex(self.root)
        self.metrics: list[dict[str, Any]] = []
        self.metric_names: set[str] = set()
        self.event_lines: dict[int, list[tuple[int, int]]] = {}
        """rollout_id -> (byte offset, length) of each of its lifecycle lines."""
        self.n_events = 0
        self._bad_event_lines: set[int] = set()
        self._attempts: OrderedDict[int, list[Attempt]] = OrderedDict()
        self._summary: dict[int, dict[str, Any]] = {}
        self._dirty: set[int] = set()
        self.sample_index: dict[int, dict[str, list[int]]] = {}
        self.n_samples = 0
        self._sample_cache: OrderedDict[tuple[int, str], list[dict[str, Any]]] = OrderedDict()
        self.config: dict[str, Any] = {}
        self._config_mtime: float | None = None
        self.config_error: str | None = None

    # ------------------------------------------------------------ reading

    def refresh(self, *, force: bool = False) -> None:
        """Read what the files gained since the last refresh (at most every 0.5 s unless forced)."""
        with self._lock:
            now = time.monotonic()
            if not force and now - self._last_refresh < REFRESH_MIN_INTERVAL_S:
                return
            self._last_refresh = now
            tails = (self.metrics_tail, self.events_tail, self.samples_tail, self.trajectories.tail)
            if any(t.reset_needed() for t in tails):
                self._reset()
            self._read_config()
            for record in self.metrics_tail.records():
                if isinstance(record.get("step"), int):
                    self.metrics.append(record)
                    self.metric_names.update(
                        k
                        for k, v in record.items()
                        if k not in ("step", "time") and (v is None or isinstance(v, int | float))
                    )
                else:
                    self.metrics_tail.count_malformed()
            self._read_events()
            self._read_samples()
            live = self.status()["state"] == "running"
            if live != self._live:
                self._live = live
                self._dirty.update(self.event_lines)  # 'running' attempts become 'unfinished'

    def _read_config(self) -> None:
        path = self.root / "config.toml"
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return
        if mtime == self._config_mtime:
            return
        self._config_mtime = mtime
        try:
            self.config = tomllib.loads(path.read_text(encoding="utf-8"))
            self.config_error = None
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            self.config_error = f"{path.name}: {exc}"

    def _read_events(self) -> None:
        tail, lines, last, spans = self.events_tail, self.event_lines, None, []
        n = 0
        for offset, line in tail.raw_lines():  # 200k lines: the loop body is kept minimal
            rid = head_int(line, _ROLLOUT_KEY)
            if rid is None:
                record = tail.parse(line)  # counts a bad line; a parseable one still lacks rollout_id
                rid = record.get("rollout_id") if record is not None else None
                if not isinstance(rid, int):
                    if record is not None:
                        tail.count_malformed()
                    continue
            if rid != last:
                spans = lines.setdefault(rid, [])
                last = rid
                self._dirty.add(rid)
            spans.append((offset, len(line)))
            n += 1
        self.n_events += n

    def _parse_events(self, rid: int) -> list[Event]:
        """The lifecycle events of rollout `rid`, parsed from their lines (bad lines counted)."""
        spans = self.event_lines.get(rid, [])
        if not spans:
            return []
        lo, hi = spans[0][0], spans[-1][0] + spans[-1][1]
        events = []
        try:
            with self.events_tail.path.open("rb") as fh:
                fh.seek(lo)
                block = fh.read(hi - lo)
        except FileNotFoundError:
            return []
        for offset, length in spans:
            try:
                record = json.loads(block[offset - lo : offset - lo + length])
            except ValueError:
                record = None
            event = event_from_record(record) if isinstance(record, dict) else None
            if event is None:
                self._bad_event_lines.add(offset)
                continue
            events.append(event)
        return events

    def _read_samples(self) -> None:
        tail = self.samples_tail
        for offset, line in tail.raw_lines():
            if not line.strip():
                continue
            m = _SAMPLE_HEAD.match(line)
            if m is not None:
                step, split = int(m.group(1)), m.group(2).decode("utf-8", "replace")
            else:
                record = tail.parse(line)
                if record is None:
                    continue
                if not isinstance(record.get("step"), int):
                    tail.count_malformed()
                    continue
                step, split = record["step"], str(record.get("split", "train"))
            self.sample_index.setdefault(step, {}).setdefault(split, []).append(offset)
            self._sample_cache.pop((step, split), None)
            self.n_samples += 1

    def _attempts_of(self, rollout_id: int, *, keep: bool = True) -> list[Attempt]:
        """The step's attempts (and its summary), parsed again when its events changed; `keep`:
        into the cache of recently viewed steps (the summaries' pass over every step does not)."""
        attempts = self._attempts.get(rollout_id)
        if rollout_id in self._dirty or attempts is None:
            attempts = build_attempts(self._parse_events(rollout_id))
            self._summary[rollout_id] = summarize(attempts, live=self.live)
            self._dirty.discard(rollout_id)
            if not keep and rollout_id not in self._attempts:
                return attempts
            self._attempts[rollout_id] = attempts
            while len(self._attempts) > _ATTEMPT_CACHE_STEPS:
                self._attempts.popitem(last=False)
        if keep:
            self._attempts.move_to_end(rollout_id)
        return attempts

    # ------------------------------------------------------------ status

    def _json_file(self, name: str) -> dict[str, Any] | None:
        try:
            data = json.loads((self.root / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def status(self) -> dict[str, Any]:
        """State (running / finished / stopped_early / failed / unknown), step, phase times, ETA."""
        status = self._json_file("status.json") or {}
        summary = self._json_file("summary.json")
        state = status.get("state")
        note = None
        if state == "running":
            pid, host = status.get("pid"), status.get("host")
            if host == socket.gethostname() and isinstance(pid, int) and not pid_alive(pid):
                state, note = "failed", f"the training process (pid {pid}) is gone without finishing"
            elif host != socket.gethostname() and time.time() - self._newest_mtime() > STALE_AFTER_S:
                note = f"no file has changed for {STALE_AFTER_S / 60:.0f} min (run on {host})"
        if state is None:
            if summary is not None:
                state = "stopped_early" if summary.get("stopped_early") else "finished"
            elif self.metrics and time.time() - self._newest_mtime() < 60:
                state = "running"
            else:
                state = "unknown"
        total = status.get("total_steps") or flatten(self.config).get("run.num_steps")
        step = max([int(status.get("step") or 0)] + [m["step"] for m in self.metrics if "time/step_s" in m])
        phases = (
            status.get("phase_seconds") or (summary or {}).get("phase_seconds") or metric_phases(self.metrics)
        )
        eta = status.get("eta_s")
        if state == "running" and isinstance(eta, int | float):
            eta = max(0.0, eta - (time.time() - float(status.get("updated_at") or time.time())))
        else:
            eta = None
        return {
            "state": state,
            "wall_s": wall_seconds(status, state, self.metrics),
            "note": note,
            "phase": status.get("phase") if state == "running" else None,
            "step": step,
            "total_steps": total,
            "phase_seconds": phases,
            "eta_s": eta,
            "error": status.get("error"),
            "started_at": status.get("started_at"),
            "updated_at": status.get("updated_at"),
        }

    @property
    def live(self) -> bool:
        """status.json said 'running' at the last refresh."""
        return self._live

    def _newest_mtime(self) -> float:
        times = []
        for name in ("metrics.jsonl", "lifecycle.jsonl", "samples.jsonl", "status.json"):
            with contextlib.suppress(FileNotFoundError):
                times.append((self.root / name).stat().st_mtime)
        return max(times, default=0.0)

    # ------------------------------------------------------------ views

    def overview(self) -> dict[str, Any]:
        """Status, config summary, eval rewards, file health, counts."""
        flat = flatten(self.config)
        evals = [
            {"step": m["step"], **{k: v for k, v in m.items() if k.startswith("eval/") and "reward" in k}}
            for m in self.metrics
            if any(k.startswith("eval/") and "reward" in k for k in m)
        ]
        return {
            "id": self.run_id,
            "name": self.name,
            "path": str(self.root),
            "status": self.status(),
            "config_summary": {k: flat[k] for k in CONFIG_SUMMARY_KEYS if k in flat},
            "config": flat,
            "config_error": self.config_error,
            "eval": evals,
            "last_rewards": last_rewards(self.metrics),
            "n_trajectories": self.trajectories.read(),
            "steps_with_events": len(self.event_lines),
            "n_events": self.n_events,
            "n_samples": self.n_samples,
            "files": [
                self.metrics_tail.health(),
                self.events_tail.health(extra_malformed=len(self._bad_event_lines)),
                self.samples_tail.health(),
                self.trajectories.tail.health(),
            ],
        }

    def curves(self, names: list[str] | None = None) -> dict[str, Any]:
        """Metric names, and the (step, value) series of `names` (all when None)."""
        wanted = sorted(self.metric_names) if names is None else [n for n in names if n in self.metric_names]
        series: dict[str, dict[str, list[Any]]] = {}
        for name in wanted:
            xs, ys, ts = [], [], []
            for m in self.metrics:
                if name in m:
                    xs.append(m["step"])
                    ys.append(m[name])
                    ts.append(m.get("time"))
            if len(xs) > MAX_CURVE_POINTS:
                stride = -(-len(xs) // MAX_CURVE_POINTS)
                xs, ys, ts = xs[::stride] + xs[-1:], ys[::stride] + ys[-1:], ts[::stride] + ts[-1:]
            series[name] = {"x": xs, "y": ys, "t": ts}
        start = next((m["time"] for m in self.metrics if isinstance(m.get("time"), int | float)), None)
        status = self._json_file("status.json") or {}
        start = status.get("started_at", start)
        return {
            "id": self.run_id,
            "name": self.name,
            "metrics": sorted(self.metric_names),
            "series": series,
            "t0": start,
        }

    def steps(self, *, budget_s: float | None = SUMMARY_BUDGET_S) -> dict[str, Any]:
        """Every step with events or samples, and the per-step timeline summary.

        Steps not summarised yet are summarised, newest first, until `budget_s` is spent (None:
        all); the rest have `summary_pending` set and are done by the next calls. The lock is
        taken per step, so a timeline request never waits for more than one step's summary."""
        deadline = None if budget_s is None else time.monotonic() + budget_s
        with self._lock:
            todo = [rid for rid in self.event_lines if rid in self._dirty or rid not in self._summary]
        for rid in sorted(todo, reverse=True):
            if deadline is not None and time.monotonic() > deadline:
                break
            with self._lock:
                if rid in self._dirty or rid not in self._summary:
                    self._attempts_of(rid, keep=False)
        with self._lock:
            rows, pending = [], 0
            for rid in sorted(self.event_lines):
                if rid in self._dirty or rid not in self._summary:
                    pending += 1
                    rows.append({"step": rid + 1, "rollout_id": rid, "summary_pending": True})
                else:
                    rows.append({"step": rid + 1, "rollout_id": rid, **self._summary[rid]})
            sample_steps = sorted(self.sample_index)
            splits = sorted({s for d in self.sample_index.values() for s in d})
        return {
            "id": self.run_id,
            "timeline_steps": rows,
            "sample_steps": sample_steps,
            "splits": splits,
            "summaries_pending": pending,
            "live": self.live,
        }

    def timeline(self, step: int, *, offset: int = 0, limit: int = 2000) -> dict[str, Any]:
        """The attempts of `step` (rows `offset` .. `offset + limit`), times relative to the first start."""
        with self._lock:
            rid = step - 1
            attempts = self._attempts_of(rid) if rid in self.event_lines else []
            live = self.live
            t0, rows = step_rows(attempts, live=live)
            summary = self._summary.get(rid) or summarize([], live=live)
        offset, limit = max(0, offset), max(1, min(limit, 20000))
        return {
            "id": self.run_id,
            "step": step,
            "rollout_id": rid,
            "t0": t0,
            "total": len(rows),
            "offset": offset,
            "limit": limit,
            "rows": rows[offset : offset + limit],
            "summary": summary,
        }

    def sample_records(self, step: int, split: str) -> list[dict[str, Any]]:
        """Every recorded sample of `step` and `split` (parsed on demand, a few steps cached)."""
        with self._lock:
            key = (step, split)
            cached = self._sample_cache.get(key)
            if cached is not None:
                self._sample_cache.move_to_end(key)
                return cached
            offsets = list(self.sample_index.get(step, {}).get(split, []))
        records = []
        try:
            with (self.root / "samples.jsonl").open("rb") as fh:
                for off in offsets:
                    fh.seek(off)
                    try:
                        record = json.loads(fh.readline())
                    except ValueError:
                        continue
                    if isinstance(record, dict):
                        records.append(record)
        except FileNotFoundError:
            return []
        with self._lock:
            self._sample_cache[key] = records
            while len(self._sample_cache) > _SAMPLE_CACHE_STEPS:
                self._sample_cache.popitem(last=False)
        return records

    def samples(
        self,
        step: int,
        *,
        split: str = "train",
        query: SampleQuery | str = "",
        offset: int = 0,
        limit: int = 50,
    ) -> dict[str, Any]:
        """A page of `step`'s samples that `query` keeps, in its order (a plain string: text search)."""
        query = query if isinstance(query, SampleQuery) else SampleQuery(text=query)
        all_records = self.sample_records(step, split)
        records = query_samples(all_records, query, reward_key=self.reward_key)
        offset, limit = max(0, offset), max(1, min(limit, 500))
        self.trajectories.read()
        recorded = self.trajectories.keys_of(step, split)
        items = [
            {**r, "has_trajectory": r.get("sample_index") in recorded}
            for r in records[offset : offset + limit]
        ]
        rewards = [v for r in all_records if (v := scalar_reward(r, self.reward_key)) is not None]
        return {
            "id": self.run_id,
            "step": step,
            "split": split,
            "query": query.text,
            "total": len(records),
            "offset": offset,
            "limit": limit,
            "items": items,
            "statuses": sorted({str(r.get("status")) for r in all_records}),
            "reward_range": [min(rewards), max(rewards)] if rewards else None,
            "reward_key": self.reward_key,
        }

    @property
    def reward_key(self) -> str | None:
        """`rollout.reward.key` of the run's config (which entry of a dict reward is the reward)."""
        key = flatten(self.config).get("rollout.reward.key")
        return key if isinstance(key, str) else None

    def trajectory(self, step: int, split: str, sample_index: int) -> dict[str, Any]:
        """The recorded full trajectory of one sample (`found: false` when none was recorded)."""
        self.trajectories.read()
        record = self.trajectories.get(step, split, sample_index)
        return {
            "id": self.run_id,
            "step": step,
            "split": split,
            "sample_index": sample_index,
            "found": record is not None,
            "trajectory": record,
        }
