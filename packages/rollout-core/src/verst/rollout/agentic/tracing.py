"""Per-turn and per-tool lifecycle events of an episode.

The rollout loop emits `turn_start` / `turn_end` around each turn (model generation plus the
environment's reply). Inside `Environment.step`, an environment marks each tool call with

    with tool_span("multiply") as span:
        ...
        span.status = "error"            # ok (default), error or timeout

which emits `tool_start` / `tool_end` (with `duration_s`) for the episode being stepped. The
episode is found through a context variable the loop sets for the duration of the step (it is
task-local, so concurrent episodes never see each other's); outside an episode, or with a
no-op sink, `tool_span` only times the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from verst.rollout.lifecycle import EventKind

Emit = Callable[[EventKind, dict[str, Any]], None]


@dataclass
class EpisodeTrace:
    """The episode a step belongs to: where its tool events go and which turn it is in."""

    emit: Emit | None
    """Emits one event of this episode (None = no events)."""
    turn: int = 0
    """The current model-turn index."""
    attempt: int | None = None
    """The sample's attempt number (as on its `attempt_start`)."""
    tool_calls: int = 0
    """Tool spans opened so far in this episode."""


@dataclass
class ToolSpan:
    """One traced tool call."""

    name: str
    index: int
    """Index of the call within its episode."""
    status: str = "ok"
    """ok, error or timeout (set it before the `with` block ends)."""
    detail: dict[str, Any] = field(default_factory=dict)
    """Extra data for the `tool_end` event."""
    duration_s: float = 0.0


_current: contextvars.ContextVar[EpisodeTrace | None] = contextvars.ContextVar(
    "verst_agentic_episode", default=None
)


@contextlib.contextmanager
def episode_trace(trace: EpisodeTrace) -> Iterator[EpisodeTrace]:
    """Make `trace` the current episode for the block (the loop wraps each env call in it)."""
    token = _current.set(trace)
    try:
        yield trace
    finally:
        _current.reset(token)


@contextlib.contextmanager
def tool_span(name: str) -> Iterator[ToolSpan]:
    """Trace one tool call of the current episode (`tool_start` / `tool_end`)."""
    trace = _current.get()
    span = ToolSpan(name, trace.tool_calls if trace else 0)
    if trace is not None:
        trace.tool_calls += 1
    base = {"attempt": trace.attempt if trace else None, "turn": trace.turn if trace else None}
    base.update(tool=name, call_id=span.index)
    if trace is not None and trace.emit is not None:
        trace.emit(EventKind.TOOL_START, dict(base))
    started = time.perf_counter()
    try:
        yield span
    except BaseException as exc:
        span.status = "cancelled" if isinstance(exc, asyncio.CancelledError) else "error"
        span.detail.setdefault("error", type(exc).__name__)
        raise
    finally:
        span.duration_s = time.perf_counter() - started
        if trace is not None and trace.emit is not None:
            trace.emit(
                EventKind.TOOL_END,
                {**base, "duration_s": span.duration_s, "status": span.status, **span.detail},
            )
