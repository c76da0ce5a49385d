"""What one full-weights push ships (`ShipPlan`), and `Planner`, which decides it.

Two savings, each exact (the engine ends with the same weights as when everything is sent):

- **the engine's dtype on the wire**: when the engine holds its weights in 16 bits
  (`EngineCapabilities.weight_dtype` bfloat16 / float16) the float32 masters are cast before
  they are serialised or written (the engine would cast them on load anyway: same rounding,
  half the bytes). Never when the engine is float32 or its dtype is not known, and not for an
  engine in this process (there is no wire: its copy casts at no extra cost).
- **each tensor once**: a tied alias (`lm_head.weight` of a model with tied embeddings: the
  same parameter under a second name) is never sent — the engine, built from the same config,
  ties it too (and SGLang's and vLLM's loaders skip it). A frozen parameter
  (`requires_grad=False`: a frozen vision tower) goes with the first push and then only when the
  engine may have lost it: the engines (`replica_states`: who each replica is and the version it
  holds) must be exactly the ones the previous push left, and the engine must take partial
  updates (`EngineCapabilities.partial_weights`). A restarted server (a new `startup_time`, its
  version starting over), a new router worker, an update from elsewhere, a colocated engine
  whose weights were released, a failed push, or a new `WeightSync` (a resumed run) all send
  everything again. Buffers are always sent (tiny, and they may change in a forward).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

NARROW = ("bfloat16", "float16")
"""Engine weight dtypes worth casting the float32 masters to before sending."""


@dataclass(frozen=True)
class ShipPlan:
    """What a push leaves out and the dtype it sends float32 tensors in."""

    skip: frozenset[str] = frozenset()
    """State-dict names not sent (tied aliases; frozen weights the engines already hold)."""
    dtype: str | None = None
    """float32 tensors are cast to this before sending (None: as trained)."""
    full: bool = True
    """Every tensor the engine needs goes (only tied aliases may be left out)."""


def apply_plan(state: Mapping[str, Any], plan: ShipPlan | None) -> dict[str, Any]:
    """`state` without the skipped names, float32 tensors cast to the plan's dtype."""
    if plan is None:
        return dict(state)
    import torch

    target = getattr(torch, plan.dtype) if plan.dtype else None
    return {
        name: t.to(target) if target is not None and t.dtype == torch.float32 else t
        for name, t in state.items()
        if name not in plan.skip
    }


def planned_nbytes(state: Mapping[str, Any], plan: ShipPlan | None) -> int:
    """Bytes `apply_plan(state, plan)` would hold, without casting anything."""
    import torch

    plan = plan or ShipPlan()
    target = getattr(torch, plan.dtype) if plan.dtype else None
    total = 0
    for name, t in state.items():
        if name in plan.skip:
            continue
        size = target.itemsize if target is not None and t.dtype == torch.float32 else t.element_size()
        total += t.numel() * size
    return total


def static_names(model: Any) -> tuple[frozenset[str], frozenset[str]]:
    """(frozen, aliases) of a model: parameter names with `requires_grad=False`, and the second
    names of parameters registered twice (tied weights)."""
    unique = dict(model.named_parameters())
    every = dict(model.named_parameters(remove_duplicate=False))
    frozen = frozenset(n for n, p in unique.items() if not p.requires_grad)
    return frozen, frozenset(every) - frozenset(unique)


class Planner:
    """Plans each push of one `WeightSync` and remembers what the engines were left holding."""

    def __init__(self, *, wire_dtype: str | None, partial: bool, aliases: bool = True) -> None:
        """`wire_dtype`: the dtype to send float32 weights in (None: as trained); `partial`:
        frozen weights may stay home when the engines still hold them; `aliases`: tied
        aliases are left out."""
        self.wire_dtype = wire_dtype if wire_dtype in NARROW else None
        self.partial = partial
        self.aliases = aliases
        self._frozen_now: frozenset[str] = frozenset()
        self._held: tuple[Any, ...] | None = None
        """The engines' replica states right after the last good push (None: unknown)."""
        self._frozen_sent: frozenset[str] = frozenset()
        """Frozen names the engines hold as they are now (sent while frozen)."""
        self._before: tuple[Any, ...] | None = None

    def plan(self, train: Any, rollout: Any) -> ShipPlan:
        """The plan of the next push (call `done` once it succeeded)."""
        names = getattr(train, "static_names", None)
        frozen, aliases = names() if names is not None else (frozenset(), frozenset())
        self._frozen_now = frozen
        # the engines' states only matter when a frozen weight could stay home: without one
        # (most runs) the two round trips to the engine per push are skipped
        self._before = _states(rollout) if self.partial and frozen else None
        held, self._held = self._held, None  # a push that fails leaves nothing trusted
        skip = set(aliases) if self.aliases else set()
        kept = (
            frozen & self._frozen_sent
            if self.partial and held is not None and self._before == held
            else set()
        )
        return ShipPlan(frozenset(skip | kept), self.wire_dtype, full=not kept)

    def done(self, rollout: Any) -> None:
        """The push succeeded: remember the engines as they are now, if they are the same
        instances as before it (a restart during the push leaves nothing trusted)."""
        if not self.partial or not self._frozen_now:
            self._held, self._frozen_sent = None, frozenset()
            return
        after = _states(rollout)
        if after is None or self._before is None or _ids(after) != _ids(self._before):
            self._held, self._frozen_sent = None, frozenset()
            return
        self._held, self._frozen_sent = after, self._frozen_now


def _states(rollout: Any) -> tuple[Any, ...] | None:
    get = getattr(rollout, "replica_states", None)
    if get is None:
        return None
    states = get()
    return None if states is None else tuple(tuple(s) for s in states)


def _ids(states: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(s[:-1] for s in states)  # without the version
