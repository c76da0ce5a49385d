"""Attempts from lifecycle events: the rows of the rollout timeline and the per-step summary.

One attempt at one sample is the events sharing (group_index, sample_index, detail.attempt)
within one rollout. Its spans:

* queued — `attempt_start` (before the concurrency semaphore) → the first `gen_start`;
* generating — each `gen_start` → `gen_end` (several for a multi-turn episode);
* scoring — the last `gen_end` → `attempt_end`;
* sub-spans — any other `<name>_start` / `<name>_end` pair (`turn_*`, `tool_*` from agentic
  rollouts, or a future kind), matched by `detail.turn` / `detail.call_id` / `detail.name` when
  present, else innermost-first; an `_end` without its start but with `detail.duration_s` spans
  the `duration_s` before it.

Events that do not carry `detail.attempt` (`gen_end`) belong to the sample's latest attempt.
The final status is `attempt_end`'s `detail.status`; an attempt without an `attempt_end` is
`unfinished` (`running` while the run is live). Retries of a sample within the step are linked
(`retry_of` names the previous attempt's row).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

STATUSES = ("completed", "truncated", "aborted", "failed", "cancelled", "unfinished", "running")
"""Final statuses the timeline colours (anything else is shown as reported)."""
_CORE = {"attempt", "gen"}
_MATCH_KEYS = ("turn", "call_id", "tool_call_id", "id", "name", "tool")


@dataclass(slots=True)
class Event:
    """One lifecycle event, as kept in memory by the reader."""

    ts: float
    kind: str
    group: int | None
    sample: int | None
    attempt: int | None
    """`detail.attempt`; None when the event does not say (`gen_end` does not)."""
    detail: dict[str, Any]


@dataclass(slots=True)
class Attempt:
    """One attempt's row."""

    group: int | None
    sample: int | None
    attempt: int
    start: float | None = None
    end: float | None = None
    gen: list[list[float | None]] = field(default_factory=list)
    sub: list[dict[str, Any]] = field(default_factory=list)
    status: str | None = None
    error: str | None = None
    message: str | None = None
    response_tokens: int | None = None
    first_ts: float = float("inf")
    last_ts: float = float("-inf")
    open_sub: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def _sub_key(detail: dict[str, Any]) -> Any:
    for key in _MATCH_KEYS:
        if key in detail:
            return detail[key]
    return None


def _label(prefix: str, detail: dict[str, Any]) -> str:
    for key in ("name", "tool", "turn"):
        if key in detail:
            return f"{prefix} {detail[key]}"
    return prefix


def build_attempts(events: Iterable[Event]) -> list[Attempt]:
    """The attempts of one rollout's events, ordered by start time."""
    attempts: dict[tuple[Any, Any, int], Attempt] = {}
    current: dict[tuple[Any, Any], int] = {}  # the sample's latest attempt, for events without one
    for ev in sorted(events, key=lambda e: e.ts):
        sample_key = (ev.group, ev.sample)
        attempt = ev.attempt if ev.attempt is not None else current.get(sample_key, 0)
        if ev.attempt is not None:
            current[sample_key] = max(current.get(sample_key, ev.attempt), ev.attempt)
        key = (ev.group, ev.sample, attempt)
        at = attempts.get(key)
        if at is None:
            at = attempts[key] = Attempt(ev.group, ev.sample, attempt)
        at.first_ts = min(at.first_ts, ev.ts)
        at.last_ts = max(at.last_ts, ev.ts)
        kind = ev.kind
        if kind == "attempt_start":
            at.start = ev.ts
        elif kind == "attempt_end":
            at.end = ev.ts
            at.status = str(ev.detail.get("status") or "unknown")
            at.error = ev.detail.get("error")
            at.message = ev.detail.get("message")
        elif kind == "gen_start":
            at.gen.append([ev.ts, None])
        elif kind == "gen_end":
            if at.gen and at.gen[-1][1] is None:
                at.gen[-1][1] = ev.ts
            else:
                at.gen.append([None, ev.ts])
            tokens = ev.detail.get("response_tokens")
            if isinstance(tokens, int):
                at.response_tokens = tokens
        elif kind.endswith("_start") and kind[:-6] not in _CORE:
            prefix = kind[:-6]
            span = {"name": _label(prefix, ev.detail), "kind": prefix, "start": ev.ts, "end": None}
            span["_key"] = _sub_key(ev.detail)
            at.open_sub.setdefault(prefix, []).append(span)
            at.sub.append(span)
        elif kind.endswith("_end") and kind[:-4] not in _CORE:
            _close_sub(at, kind[:-4], ev)
    out = list(attempts.values())
    for at in out:
        if at.start is None:
            at.start = at.first_ts
        for span in at.sub:
            span.pop("_key", None)
        at.open_sub.clear()
    out.sort(key=lambda a: (a.start, a.group if a.group is not None else -1, a.sample or 0, a.attempt))
    return out


def _close_sub(at: Attempt, prefix: str, ev: Event) -> None:
    stack = at.open_sub.get(prefix, [])
    key = _sub_key(ev.detail)
    match = None
    for span in reversed(stack):
        if key is None or span["_key"] == key:
            match = span
            break
    if match is not None:
        stack.remove(match)
    else:
        duration = ev.detail.get("duration_s")
        start = ev.ts - float(duration) if isinstance(duration, int | float) else None
        match = {"name": _label(prefix, ev.detail), "kind": prefix, "start": start, "_key": key}
        at.sub.append(match)
    match["end"] = ev.ts
    extra = {k: v for k, v in ev.detail.items() if k not in ("attempt",)}
    if extra:
        match["detail"] = extra


def _r(value: float | None, t0: float) -> float | None:
    return None if value is None else round(value - t0, 4)


def attempt_row(at: Attempt, t0: float, *, live: bool, step_end: float) -> dict[str, Any]:
    """The JSON row of one attempt; times are seconds after `t0`."""
    end = at.end if at.end is not None else (at.last_ts if not live else max(at.last_ts, step_end))
    status = at.status or ("running" if live else "unfinished")
    gen_spans = [[s if s is not None else at.start, e if e is not None else end] for s, e in at.gen]
    queued_end = gen_spans[0][0] if gen_spans else end
    score_start = gen_spans[-1][1] if gen_spans else None
    return {
        "group": at.group,
        "sample": at.sample,
        "attempt": at.attempt,
        "status": status,
        "start": _r(at.start, t0),
        "queued_end": _r(queued_end, t0),
        "gen": [[_r(s, t0), _r(e, t0)] for s, e in gen_spans],
        "score_start": _r(score_start, t0),
        "end": _r(end, t0),
        "finished": at.end is not None,
        "error": at.error,
        "message": at.message,
        "response_tokens": at.response_tokens,
        "sub": [
            {
                **{k: v for k, v in s.items() if k not in ("start", "end")},
                "start": _r(s["start"] if s["start"] is not None else at.start, t0),
                "end": _r(s["end"] if s["end"] is not None else end, t0),
            }
            for s in at.sub
        ],
    }


def step_rows(attempts: list[Attempt], *, live: bool) -> tuple[float, list[dict[str, Any]]]:
    """(t0, rows) of a step, with retries linked by `retry_of` (a row index)."""
    if not attempts:
        return 0.0, []
    t0 = min(a.start for a in attempts if a.start is not None)
    step_end = max(a.last_ts for a in attempts)
    rows = [attempt_row(a, t0, live=live, step_end=step_end) for a in attempts]
    last: dict[tuple[Any, Any], int] = {}
    order = sorted(range(len(rows)), key=lambda i: rows[i]["attempt"])
    for i in order:
        key = (rows[i]["group"], rows[i]["sample"])
        rows[i]["retry_of"] = last.get(key)
        last[key] = i
    return t0, rows


def summarize(attempts: list[Attempt], *, live: bool) -> dict[str, Any]:
    """Per-step totals: attempts, statuses, mean queue / generation / scoring seconds, wall time."""
    counts: dict[str, int] = {}
    queue = gen = score = 0.0
    n_timed = 0
    for at in attempts:
        status = at.status or ("running" if live else "unfinished")
        counts[status] = counts.get(status, 0) + 1
        if at.end is None or at.start is None:
            continue
        spans = [(s if s is not None else at.start, e if e is not None else at.end) for s, e in at.gen]
        n_timed += 1
        if spans:
            queue += spans[0][0] - at.start
            gen += sum(e - s for s, e in spans)
            score += at.end - spans[-1][1]
        else:
            queue += at.end - at.start
    starts = [a.start for a in attempts if a.start is not None]
    wall = (max(a.last_ts for a in attempts) - min(starts)) if starts else 0.0
    n = max(1, n_timed)
    return {
        "attempts": len(attempts),
        "samples": len({(a.group, a.sample) for a in attempts}),
        "retries": sum(1 for a in attempts if a.attempt > 0),
        "status_counts": counts,
        "queue_s_mean": round(queue / n, 5),
        "gen_s_mean": round(gen / n, 5),
        "score_s_mean": round(score / n, 5),
        "wall_s": round(wall, 4),
    }


def event_from_record(record: dict[str, Any]) -> Event | None:
    """A lifecycle line's object as an `Event` (None when it lacks a kind or a timestamp)."""
    kind, ts = record.get("kind"), record.get("timestamp")
    if not (isinstance(kind, str) and isinstance(ts, int | float)):
        return None
    detail = record.get("detail")
    detail = detail if isinstance(detail, dict) else {}
    attempt = detail.get("attempt")
    group, sample = record.get("group_index"), record.get("sample_index")
    return Event(
        float(ts),
        kind,
        group if isinstance(group, int) else None,
        sample if isinstance(sample, int) else None,
        attempt if isinstance(attempt, int) else None,
        detail,
    )
