"""The seams of weight sync: what a transport needs of the train and rollout sides, what a mode
is built with, the transport protocol, and its error. Every mode (`modes`, `distributed`)
imports these; this module imports no mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from verst.rollout.engine import EngineCapabilities


class WeightSyncError(RuntimeError):
    """The engine did not end up on the weight version the trainer pushed (or cannot receive it)."""


class TrainSurface(Protocol):
    """What a transport needs of the train side."""

    def state_dict_for_sync(self, plan: Any = None) -> dict:
        """The full weights; with a `verst.trainer.sync.plan.ShipPlan`, as it says (names left
        out, float32 cast). A train side may also offer `static_names() -> (frozen, aliases)`
        (`plan.static_names`); without it nothing is left out but the cast."""
        ...

    def save_hf(self, path: str | Path, state_dict: dict | None = None) -> None: ...


class RolloutSurface(Protocol):
    """What a transport needs of the rollout side (a `RolloutSide` or its Ray proxy)."""

    engine_capabilities: EngineCapabilities
    engine: Any

    def submit(self, coro: Any) -> Any: ...

    def update_weights_from_tensors(self, named_tensors: dict, weight_version: int) -> int: ...
    def update_weights_from_disk(self, path: str, weight_version: int) -> int: ...

    # optional: `replica_states() -> list[tuple] | None` (`verst.rollout.engines.common.replicas`;
    # None = not known, e.g. released weights): without it every push sends frozen weights too.


@dataclass(frozen=True)
class SyncContext:
    """What a mode is built with (on the rank that talks to the engine)."""

    train: TrainSurface
    staging_dir: Path
    """disk: where the versions are written (`<run>/weights`)."""
    shares_gpu_with_engine: bool = False
    """The trainer's GPU also holds an engine (a colocated layout)."""


class WeightTransport(Protocol):
    """Moves one version of the weights to the engines."""

    def push(self, rollout: RolloutSurface, state: dict, version: int) -> int:
        """Send `state` (the full state dict) as `version`; return the version the engine reports."""
        ...

    def close(self) -> None:
        """Release what the transport holds (a process group); safe to call more than once."""
        ...
