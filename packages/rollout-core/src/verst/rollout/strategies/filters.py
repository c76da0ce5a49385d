"""Dynamic filters: decide, per finished group, whether over-sampling keeps it.

A filter is any callable `(group: list[Sample]) -> FilterOutcome`. Built-ins live in one table
(`BUILTIN_FILTERS`); anything else is loaded by import path. A v1 filter (slime's dynamic
sampling filter) may return a bare bool or an object with `keep` and `reason`; it is wrapped
so the strategy always sees a `FilterOutcome`. Each drop reason becomes a metric
`rollout/dropped/<reason>`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from verst.rollout.importing import import_object
from verst.rollout.sample import Sample, Status


@dataclass(frozen=True, slots=True)
class FilterOutcome:
    """A filter's decision about one group."""

    keep: bool
    """Keep the group for training."""
    reason: str | None = None
    """Why it was dropped (a short metric-friendly name); None when kept."""


KEEP = FilterOutcome(True)
"""The outcome of a filter that keeps the group."""


@runtime_checkable
class DynamicFilter(Protocol):
    """Decides whether a finished group is kept."""

    def __call__(self, group: list[Sample]) -> FilterOutcome: ...


@dataclass(frozen=True, slots=True)
class NonzeroStd:
    """Keep groups whose rewards are not all equal (an all-equal group has zero GRPO advantage).

    Samples without a reward (aborted, failed) are left out of the comparison.
    """

    reward_key: str | None = None
    """For dict rewards: the key compared."""

    def __call__(self, group: list[Sample]) -> FilterOutcome:
        rewards = [s.scalar_reward(self.reward_key) for s in group if s.reward is not None]
        if rewards and max(rewards) != min(rewards):
            return KEEP
        return FilterOutcome(False, "zero_std")


@dataclass(frozen=True, slots=True)
class NoAborted:
    """Keep groups in which no sample was aborted."""

    def __call__(self, group: list[Sample]) -> FilterOutcome:
        if any(s.status is Status.ABORTED for s in group):
            return FilterOutcome(False, "aborted")
        return KEEP


BUILTIN_FILTERS: dict[str, Callable[[str | None], DynamicFilter]] = {
    "nonzero_std": lambda reward_key: NonzeroStd(reward_key),
    "no_aborted": lambda reward_key: NoAborted(),
}
"""Built-in filters by name: name → factory taking the reward key."""


@dataclass(frozen=True, slots=True)
class _NormalizedFilter:
    """Wraps a user filter so it returns a `FilterOutcome` (from a bool or a keep/reason object)."""

    fn: Callable[[list[Sample]], Any]
    name: str

    def __call__(self, group: list[Sample]) -> FilterOutcome:
        out = self.fn(group)
        if isinstance(out, FilterOutcome):
            return out
        if isinstance(out, bool):
            return KEEP if out else FilterOutcome(False, self.name)
        keep = getattr(out, "keep", None)
        if isinstance(keep, bool):
            reason = getattr(out, "reason", None)
            return KEEP if keep else FilterOutcome(False, str(reason or self.name))
        raise TypeError(
            f"dynamic filter {self.name!r} returned {type(out).__name__}; "
            f"it must return a FilterOutcome(keep, reason), a bool, or an object with .keep and .reason"
        )


def _metric_name(path: str) -> str:
    return path.replace(":", ".").rsplit(".", 1)[-1]


def load_dynamic_filter(name_or_path: str, reward_key: str | None = None) -> DynamicFilter:
    """A built-in filter by name (see `BUILTIN_FILTERS`) or a user filter by import path.

    A class is instantiated (with `reward_key` if its constructor takes it); a function is used
    as is. Either may return a `FilterOutcome`, a bool, or an object with `keep`/`reason`.
    """
    factory = BUILTIN_FILTERS.get(name_or_path)
    if factory is not None:
        return factory(reward_key)
    if ":" not in name_or_path and "." not in name_or_path:
        raise ValueError(
            f"unknown dynamic filter {name_or_path!r}; use one of {sorted(BUILTIN_FILTERS)} "
            f"or an import path 'pkg.module:filter'"
        )
    obj = import_object(name_or_path, what="dynamic filter")
    if inspect.isclass(obj):
        params = inspect.signature(obj).parameters
        obj = obj(reward_key=reward_key) if "reward_key" in params else obj()
    if not callable(obj):
        raise TypeError(f"dynamic filter {name_or_path!r} is a {type(obj).__name__}, not a callable")
    return _NormalizedFilter(obj, _metric_name(name_or_path))


def apply_filters(filters: list[DynamicFilter], group: list[Sample]) -> FilterOutcome:
    """The first rejecting filter's outcome, or KEEP."""
    for f in filters:
        outcome = f(group)
        if not outcome.keep:
            return outcome
    return KEEP
