"""Driver-side proxies of the two sides: `TrainProxy` (the `TrainSide` surface over the train
actors) and `RolloutProxy` (the `RolloutSide` surface over the rollout manager), calling through
`proxies.RayPlacement`, which owns the actors.

Weights for the engine (`state_dict_for_sync`) stay in Ray's object store: the driver passes a
`RemoteStateDict` from train rank 0 to the rollout manager without fetching the tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verst.rollout.engine import EngineCapabilities
from verst.rollout.lifecycle import LifecycleSink
from verst.trainer.placement.actors import CONTROL_GROUP, RolloutStopped
from verst.trainer.placement.ray_cluster import require_ray
from verst.trainer.run.rollout_side import RolloutInterrupted

if TYPE_CHECKING:
    from verst.trainer.placement.proxies import ActorInfo, RayPlacement


@dataclass
class RemoteStateDict:
    """Weights still in Ray's object store (train rank 0's `state_dict_for_sync` result)."""

    ref: Any
    """The ObjectRef; actors receiving it as an argument get the dict itself."""
    nbytes: int | None = None
    """Bytes of its tensors (for the `sync/bytes` metric), as train rank 0 counted them."""


class TrainProxy:
    """`TrainSide`'s surface over the train actors (FSDP ranks)."""

    def __init__(self, placement: RayPlacement) -> None:
        self._p = placement

    def train_step(self, batch: Any) -> dict[str, float]:
        """Every rank trains on its share of the batch (sent once through the object store)."""
        ref = require_ray().put(batch)
        return self._p.call(self._p.train_actors, "train_step", ref)[0]

    def step_detail(self) -> Any:
        """Rank 0's per-sample values of the last step (`TrainSide.step_detail`)."""
        return self._p.call(self._p.train_actors[:1], "step_detail")[0]

    remote = True
    """The weights leave this process on their way to the engine (`WeightSync` casts for it)."""

    def state_dict_for_sync(self, plan: Any = None) -> RemoteStateDict:
        """Gather the full weights (a collective over the ranks; with a refit's `plan`, as it
        says); they stay in the object store."""
        refs = self._p.call(self._p.train_actors, "state_dict_for_sync", plan, fetch=False)
        nbytes = self._p.call(self._p.train_actors[:1], "state_nbytes", plan)[0]
        return RemoteStateDict(refs[0], nbytes)

    def static_names(self) -> tuple[frozenset[str], frozenset[str]]:
        """Train rank 0's (frozen, tied aliases) names (`verst.trainer.sync.plan`)."""
        return self._p.call(self._p.train_actors[:1], "static_names")[0]

    def save_hf(self, path: str | Path, state_dict: Any = None) -> None:
        """Rank 0 writes a Hugging Face checkpoint of these weights (gathered now if not given)."""
        sd = state_dict if state_dict is not None else self.state_dict_for_sync()
        arg = sd.ref if isinstance(sd, RemoteStateDict) else sd
        self._p.call(self._p.train_actors[:1], "save_hf", str(path), arg)

    def save(self, path: str | Path) -> None:
        """Model, optimizer, scheduler into `path` (every rank joins; rank 0 writes)."""
        self._p.call(self._p.train_actors, "save", str(path))

    def load(self, path: str | Path) -> None:
        """Every rank restores what `save` wrote."""
        self._p.call(self._p.train_actors, "load", str(path))

    def close(self) -> None:
        """End the placement: close and stop every actor, free the bundles."""
        self._p.close()


class RolloutProxy:
    """`RolloutSide`'s surface over the rollout manager actor."""

    def __init__(self, placement: RayPlacement) -> None:
        self._p = placement
        self.has_eval = False
        """Eval datasets are configured."""
        self.engine_capabilities = EngineCapabilities()
        """What the rollout manager's engine can do (e.g. take weights as tensors, which then go
        through Ray's object store)."""
        self.strategy_path = ""
        """The strategy the rollout manager resolved from its environment."""
        self.engine_holds_model = False
        """The manager's engine loaded the trainer's model for this run (`RolloutSide`'s)."""
        self.info: dict[str, Any] = {}
        """Everything the rollout manager reported after setup."""
        self.sink: LifecycleSink | None = None
        """Where the rollout manager's lifecycle events go (the driver's `lifecycle.jsonl`)."""

    def _set_info(self, info: dict[str, Any]) -> None:
        self.info = dict(info)
        self.has_eval = bool(info["has_eval"])
        self.engine_capabilities = info["engine_capabilities"]
        self.engine_holds_model = bool(info.get("engine_holds_model", False))
        self.strategy_path = str(info["strategy_path"])

    def _actor(self) -> ActorInfo:
        actor = self._p.rollout_actor
        if actor is None:
            raise RuntimeError("the rollout manager is closed")
        return actor

    def _call(self, method: str, *args: Any) -> Any:
        return self._p.call([self._actor()], method, *args)[0]

    def _relay_events(self) -> None:
        """Write the lifecycle events the rollout manager buffered since the last call."""
        if self.sink is not None:
            for event in self._call("drain_events"):
                self.sink.emit(event)

    def rollout(self, rollout_id: int, weight_version: int, *, stop: Callable[[], bool] | None = None) -> Any:
        """One training rollout in the rollout manager. Once `stop()` turns true (polled every
        `POLL_S`) the manager is told to stop it (`interrupt`, beside the running call): the
        strategy aborts its requests and hands the groups back, and `RolloutInterrupted` is
        raised here, as `RolloutSide.rollout` does in one process."""
        actor, asked = self._actor(), []

        def check_stop() -> None:
            if stop is not None and not asked and stop():
                asked.append(True)
                actor.handle.interrupt.options(concurrency_group=CONTROL_GROUP).remote(rollout_id)

        call = (actor, "rollout", (rollout_id, weight_version))
        result = self._p.call_each([call], while_waiting=check_stop)[0]
        self._relay_events()
        if isinstance(result, RolloutStopped):
            raise RolloutInterrupted(f"{result.message} (in the Ray rollout manager)")
        return result

    def evaluate(self, rollout_id: int, weight_version: int) -> Any:
        result = self._call("evaluate", rollout_id, weight_version)
        self._relay_events()
        return result

    def update_weights_from_tensors(self, named_tensors: Any, weight_version: int) -> int:
        arg = named_tensors.ref if isinstance(named_tensors, RemoteStateDict) else named_tensors
        return self._call("update_weights_from_tensors", arg, weight_version)

    def update_weights_from_disk(self, path: str, weight_version: int) -> int:
        return self._call("update_weights_from_disk", path, weight_version)

    def weight_version(self) -> int:
        return self._call("weight_version")

    def replica_states(self) -> list | None:
        return self._call("replica_states")

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load_state_dict", state)

    def close(self, *, close_engine: bool = True) -> None:
        """Close the strategy and the engines inside the actor (relaying its last events), then end it."""
        if self.sink is not None and self._p.rollout_actor is not None and not self._p.closed:
            with contextlib.suppress(Exception):  # as before: a failing close must not mask the run's result
                for event in self._call("close_side", close_engine):
                    self.sink.emit(event)
        self._p.close_rollout(close_engine)
