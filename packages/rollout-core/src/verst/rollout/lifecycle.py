"""Trajectory lifecycle events and the sinks that receive them.

`generate_and_rm` emits, per attempt at one sample: `attempt_start` (before waiting on the
concurrency semaphore, so queue time is visible), `gen_start`, `gen_end`, and `attempt_end`
(in a `finally`: exactly once, on success, abort, exception and cancellation). A sink is
passed in through the rollout context; there is no global singleton.
"""

from __future__ import annotations

import enum
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


class EventKind(enum.StrEnum):
    """The lifecycle events of one attempt at one sample.

    Every attempt: `attempt_start`, `gen_start`, `gen_end`, `attempt_end`. Agentic episodes add,
    between `gen_start` and `gen_end`, one `turn_start` / `turn_end` pair per turn (detail:
    `turn`, and on the end `duration_s`, `queue_s`, `gen_s`, `env_s`, token counts) and one
    `tool_start` / `tool_end` pair per traced tool call (detail: `turn`, `tool`, `call_id`, and on
    the end `duration_s`, `status`).
    """

    ATTEMPT_START = "attempt_start"
    GEN_START = "gen_start"
    GEN_END = "gen_end"
    ATTEMPT_END = "attempt_end"
    TURN_START = "turn_start"
    TURN_END = "turn_end"
    TOOL_START = "tool_start"
    TOOL_END = "tool_end"


@dataclass(frozen=True, slots=True)
class LifecycleEvent:
    """One lifecycle event."""

    kind: EventKind
    """Which event."""
    rollout_id: int
    """The rollout the sample belongs to."""
    group_index: int | None
    """The sample's group index."""
    sample_index: int | None
    """The sample's index within the rollout."""
    weight_version: int | None
    """The engine weight version the rollout was requested at."""
    detail: dict[str, Any] = field(default_factory=dict)
    """Event-specific data: status, error type, attempt number, token counts..."""
    timestamp: float = field(default_factory=time.time)
    """Wall-clock time (seconds since the epoch)."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON line written by `JsonlSink`."""
        return {
            "kind": self.kind.value,
            "timestamp": self.timestamp,
            "rollout_id": self.rollout_id,
            "group_index": self.group_index,
            "sample_index": self.sample_index,
            "weight_version": self.weight_version,
            "detail": self.detail,
        }


@runtime_checkable
class LifecycleSink(Protocol):
    """Receives lifecycle events. Must be cheap and must not raise."""

    def emit(self, event: LifecycleEvent) -> None:
        """Record one event."""
        ...

    def close(self) -> None:
        """Flush and release resources."""
        ...


class NoopSink:
    """Drops every event (the default when no sink is configured)."""

    def emit(self, event: LifecycleEvent) -> None:
        pass

    def close(self) -> None:
        pass


class ListSink:
    """Keeps events in memory, in order (for tests and for in-process inspection)."""

    def __init__(self) -> None:
        self.events: list[LifecycleEvent] = []

    def emit(self, event: LifecycleEvent) -> None:
        self.events.append(event)

    def close(self) -> None:
        pass


_ENCODER = json.JSONEncoder(default=str)
"""Shared by every `JsonlSink` (`json.dumps` with `default=` builds a new encoder per call)."""


class JsonlSink:
    """Appends one JSON object per event to a file (thread-safe).

    Lines reach the file at most `flush_interval_s` after they are emitted (a timer flushes),
    and at `flush` / `close`; `flush_interval_s=0` writes every line through at once. Batching
    the writes matters: a rollout emits four events per sample, and one write per event costs
    the rollout thread a system call (and a GIL hand-off to the engine thread) each time.
    """

    def __init__(self, path: str | Path, *, flush_interval_s: float = 0.5) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.flush_interval_s = flush_interval_s
        """Longest time an emitted line waits in the buffer (0 = line-buffered)."""
        self._lock = threading.Lock()
        self._file = self.path.open("a", buffering=1 if flush_interval_s <= 0 else -1, encoding="utf-8")
        self._timer: threading.Timer | None = None

    def emit(self, event: LifecycleEvent) -> None:
        line = _ENCODER.encode(event.to_dict())  # = json.dumps(..., default=str), one encoder
        with self._lock:
            if self._file.closed:
                return
            self._file.write(line + "\n")
            if self.flush_interval_s > 0 and self._timer is None:
                self._timer = threading.Timer(self.flush_interval_s, self.flush)
                self._timer.daemon = True
                self._timer.start()

    def flush(self) -> None:
        """Write buffered lines to the file now."""
        with self._lock:
            self._timer = None
            if not self._file.closed:
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._file.close()
