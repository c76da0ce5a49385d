"""Counters of model rewards in the run metrics, per rollout.

A reward with a `counters()` method (totals since it was built, e.g. `JudgeReward`'s calls,
cache hits and errors) and a `counter_prefix` (`"reward/judge"`) shows up in each rollout's
metrics as `<prefix>/<counter>`: what that rollout added (not the run's totals), so a step's
`reward/judge/calls` is the judge calls that step made. Rewards wrapped for group scoring
(`GroupOfSampleRewards.reward_fn`) are found through the wrapper.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def counted_rewards(rewards: Iterable[Any]) -> list[Any]:
    """The rewards among `rewards` (and their wrapped `reward_fn`s) that keep counters."""
    out: list[Any] = []
    for reward in rewards:
        for fn in (reward, getattr(reward, "reward_fn", None)):
            if fn is not None and callable(getattr(fn, "counters", None)) and fn not in out:
                out.append(fn)
    return out


class RewardCounters:
    """Per-rollout deltas of the counters of some rewards."""

    def __init__(self, rewards: Iterable[Any]) -> None:
        self.rewards = counted_rewards(rewards)
        """The rewards that keep counters."""
        self._last: list[dict[str, int]] = [dict(r.counters()) for r in self.rewards]
        self._carried: dict[str, float] = {}

    def delta(self, prefix: str = "") -> dict[str, float]:
        """`{prefix + reward.counter_prefix + "/" + name: added since the last call}`."""
        out: dict[str, float] = {}
        for i, reward in enumerate(self.rewards):
            now = dict(reward.counters())
            base = f"{prefix}{getattr(reward, 'counter_prefix', 'reward')}"
            for name, value in now.items():
                key = f"{base}/{name}"
                out[key] = out.get(key, 0.0) + float(value - self._last[i].get(name, 0))
            self._last[i] = now
        for key, value in self._carried.items():
            out[key] = out.get(key, 0.0) + value
        self._carried = {}
        return out

    def carry(self, counts: dict[str, float]) -> None:
        """Add `counts` (an unprefixed `delta()`) to the next `delta()`: an eval takes what the
        rewards counted before it started and hands it back to the next training rollout."""
        for key, value in counts.items():
            self._carried[key] = self._carried.get(key, 0.0) + value
