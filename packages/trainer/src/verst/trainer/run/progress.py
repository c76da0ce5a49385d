"""A live progress display: step, phase (rollout / train / sync / eval), reward, time left.

On a terminal it is one line rewritten in place; otherwise (CI logs, files) it prints one plain
line per logged step, so logs stay readable. The estimate of time left is the mean time of the
finished steps times the steps remaining.
"""

from __future__ import annotations

import fnmatch
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

REWARD_KEYS = ("rollout/reward_mean", "rollout/reward", "train/reward_mean", "reward_mean", "reward")
"""Metric names shown as the reward, in order of preference."""
EVAL_KEYS = ("eval/reward_mean", "eval/*/reward_mean", "eval/reward")
"""Metric names shown as the eval reward."""


def format_duration(seconds: float) -> str:
    """`83` → `1m23s`; `4000` → `1h06m`."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class ProgressDisplay:
    """Shows the run's progress; feed it `phase(name)` and `log(step, metrics)`."""

    def __init__(
        self,
        total_steps: int,
        *,
        stream: TextIO | None = None,
        live: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        start_step: int = 0,
    ) -> None:
        self.total_steps = total_steps
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self._clock = clock
        self._start = clock()
        self._start_step = start_step
        self.step = start_step
        self.phase_name = "start"
        self.reward: float | None = None
        self.eval_reward: float | None = None
        self._width = 0
        self._first_rollout: float | None = None

    def eta_seconds(self) -> float | None:
        """Estimated seconds left, or None before the first step finished.

        Timed from the first `rollout` phase, so start-up (model loading, the initial eval) does
        not inflate the per-step estimate.
        """
        done = self.step - self._start_step
        if done <= 0:
            return None
        per_step = (
            self._clock() - (self._start if self._first_rollout is None else self._first_rollout)
        ) / done
        return per_step * max(0, self.total_steps - self.step)

    def line(self) -> str:
        """The current status line."""
        parts = [f"step {self.step}/{self.total_steps}", f"{self.phase_name:<7}"]
        if self.reward is not None:
            parts.append(f"reward {self.reward:.3f}")
        if self.eval_reward is not None:
            parts.append(f"eval {self.eval_reward:.3f}")
        parts.append(f"elapsed {format_duration(self._clock() - self._start)}")
        eta = self.eta_seconds()
        parts.append(f"eta {format_duration(eta)}" if eta is not None else "eta ?")
        return " | ".join(parts)

    def phase(self, name: str) -> None:
        """The run entered a phase (rollout, train, sync, eval, checkpoint...)."""
        self.phase_name = name
        if name == "rollout" and self._first_rollout is None:
            self._first_rollout = self._clock()
        if self.live:
            self._draw()

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """A step's metrics arrived."""
        self.step = max(self.step, step)
        self.reward = _first(metrics, REWARD_KEYS, self.reward)
        self.eval_reward = _first(metrics, EVAL_KEYS, self.eval_reward)
        if self.live:
            self._draw()
        else:
            print(self.line(), file=self.stream, flush=True)

    def message(self, text: str) -> None:
        """Print a message above the live line."""
        if self.live and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
        print(text, file=self.stream, flush=True)
        if self.live:
            self._draw()

    def close(self) -> None:
        """End the live line."""
        if self.live and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0

    def _draw(self) -> None:
        text = self.line()
        pad = max(0, self._width - len(text))
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()
        self._width = len(text)


def _first(metrics: Mapping[str, Any], keys: tuple[str, ...], default: float | None) -> float | None:
    for pattern in keys:
        names = sorted(fnmatch.filter(metrics, pattern)) if "*" in pattern else [pattern]
        for key in names:
            value = metrics.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                return float(value)
    return default
