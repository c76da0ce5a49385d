"""Driver-side proxies: the `TrainSide` / `RolloutSide` surface, implemented by calling actors.

`RayPlacement.start` connects to Ray, reserves the train placement group, starts the actors
(`verst-<tag>-train-<rank>`, `verst-<tag>-rollout`, in `run.ray.namespace`) with the effective
environment as their runtime env, and builds them. `run_training` then uses `placement.train`
and `placement.rollout` exactly like the local sides.

Every call waits on the actors with `ray.wait`, so one dead rank fails the call at once instead
of leaving the others blocked in a collective. Any failure tears the whole placement down (kills
the actors, removes the placement group) and raises: an actor death as `ActorDiedError` naming
the actor and quoting its last log lines; an exception inside an actor as itself, with a note
naming the actor. The run directory keeps its checkpoints: running again resumes.

Weights for the engine (`state_dict_for_sync`) stay in Ray's object store: the driver passes a
`RemoteStateDict` from train rank 0 to the rollout manager without fetching the tensors.
"""

from __future__ import annotations

import contextlib
import sys
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verst.rollout.engine import EngineCapabilities
from verst.rollout.errors import ConfigError, Problem
from verst.rollout.lifecycle import LifecycleSink
from verst.trainer.config import RunConfig
from verst.trainer.placement.layout import PlacementPlan, plan_placement, resolve_device
from verst.trainer.placement.ray_cluster import (
    RayConnection,
    actor_env_vars,
    connect,
    require_ray,
    runtime_env,
)
from verst.trainer.run.checkpoint import latest_checkpoint

PLACEMENT_GROUP_TIMEOUT_S = 300.0
"""How long to wait for the cluster to grant the train placement group."""
CLOSE_TIMEOUT_S = 60.0
"""How long a polite close of the actors may take before they are killed."""
PEER_DEATH_WAIT_S = 15.0
"""After an error on one actor, how long to wait for news of a dead peer (the likelier cause);
Ray can take several seconds to report a killed actor on a busy machine (5 s was too short)."""


class ActorDiedError(RuntimeError):
    """A verst actor died (killed, out of memory, node lost) while the run needed it."""

    def __init__(self, message: str, *, actor: str, method: str, log_lines: list[str]) -> None:
        super().__init__(message)
        self.actor = actor
        """The actor's short name (`train-0`, `rollout`)."""
        self.method = method
        """The call in flight when it died."""
        self.log_lines = log_lines
        """Its last log lines."""


@dataclass
class ActorInfo:
    """The driver's record of one actor."""

    name: str
    """Short name: `train-<rank>` or `rollout`."""
    ray_name: str
    """The Ray actor name (`ray.get_actor(ray_name, namespace=...)`)."""
    role: str
    """What it is, for messages: 'train rank 0 of 2', 'rollout manager'."""
    handle: Any
    """The Ray actor handle."""
    log_file: Path
    """Where it appends its log (readable from the driver on one machine or a shared filesystem)."""
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=30))
    """Its newest log lines, as received with each call's result."""
    where: str = "pid ?, node ?"
    """Its process and node (filled after start)."""


@dataclass
class RemoteStateDict:
    """Weights still in Ray's object store (train rank 0's `state_dict_for_sync` result)."""

    ref: Any
    """The ObjectRef; actors receiving it as an argument get the dict itself."""
    nbytes: int | None = None
    """Bytes of its tensors (for the `sync/bytes` metric), as train rank 0 counted them."""


def _read_tail(path: Path, n: int) -> list[str] | None:
    try:
        with path.open("rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            lines = fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    return lines[-n:]


class RayPlacement:
    """The actors of one run, and the proxies that call them."""

    def __init__(
        self, config: RunConfig, run_dir: Path, conn: RayConnection, plan: PlacementPlan, tag: str
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.conn = conn
        self.plan = plan
        self.tag = tag
        """Unique part of this run's actor names."""
        self.namespace = config.run.ray.namespace
        self.pg: Any = None
        self.train_actors: list[ActorInfo] = []
        self.rollout_actor: ActorInfo | None = None
        self.engine_actors: list[ActorInfo] = []
        """The engine actors (`run.ray.engine_actors`), owned here, used by the rollout manager."""
        self.closed = False
        self.train = TrainProxy(self)
        """The `TrainSide` surface."""
        self.rollout: RolloutProxy = RolloutProxy(self)
        """The `RolloutSide` surface."""

    # ------------------------------------------------------------ start

    @classmethod
    def start(
        cls,
        config: RunConfig,
        run_dir: str | Path,
        *,
        model_path: str,
        env: Mapping[str, str],
        sink: LifecycleSink | None = None,
    ) -> RayPlacement:
        """Connect, reserve the bundles, start and build every actor (torn down on any failure).

        `sink` receives the rollout manager's lifecycle events (drained after each call), so
        they land in the driver's run directory."""
        ray = require_ray(local_cluster=not config.run.ray_address, join=config.run.ray_address)
        rc = config.run.ray
        cpu_plan = plan_placement(rc, "cpu")  # CPU reservations do not depend on the device
        need = sum(b["CPU"] for b in cpu_plan.bundles) + (
            cpu_plan.rollout.num_cpus if cpu_plan.rollout.bundle is None else 0.0
        )
        conn = connect(config.run.ray_address, namespace=rc.namespace, min_cpus=need)
        device = resolve_device(rc, conn.cluster_gpus())
        if config.train.fsdp and device == "cpu" and rc.num_train_actors < 2:
            conn.close()
            raise ConfigError(
                [
                    Problem(
                        "run.ray.num_train_actors",
                        "train.fsdp=true with one CPU train actor would run unsharded (no GPUs in the cluster)",
                        "set run.ray.num_train_actors=2 (or more), or train.fsdp=false",
                    )
                ]
            )
        self = cls(config, Path(run_dir), conn, plan_placement(rc, device), uuid.uuid4().hex[:8])
        self.rollout.sink = sink
        try:
            self._start_actors(ray, env, model_path)
        except BaseException:
            self.abort()
            raise
        return self

    def _start_actors(self, ray: Any, env: Mapping[str, str], model_path: str) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from verst.trainer.placement.actors import RolloutManagerActor, TrainActor
        from verst.trainer.placement.engine_actors import EngineActor

        cfg, plan = self.config, self.plan
        self.pg = placement_group(plan.bundles, strategy="PACK", name=f"verst-{self.tag}-train")
        ready, _ = ray.wait([self.pg.ready()], timeout=PLACEMENT_GROUP_TIMEOUT_S)
        if not ready:
            raise RuntimeError(
                f"the Ray cluster did not grant the train bundles {plan.bundles} within "
                f"{PLACEMENT_GROUP_TIMEOUT_S:.0f} s (cluster resources: {ray.cluster_resources()}); "
                "lower run.ray.num_train_actors / cpus_per_train_actor, or add nodes"
            )
        env_vars = actor_env_vars(env, cfg.run.env)
        common = {
            "log_lines": cfg.run.ray.log_tail_lines,
            "sys_path": [p for p in sys.path if p],
        }

        def options(name: str, slot: Any) -> dict[str, Any]:
            opts: dict[str, Any] = {
                "name": f"verst-{self.tag}-{name}",
                "namespace": self.namespace,
                "num_cpus": slot.num_cpus,
                "num_gpus": slot.num_gpus,
                "runtime_env": runtime_env(env_vars),
                "max_restarts": 0,
            }
            if slot.bundle is not None:
                opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=slot.bundle
                )
            return opts

        def info(name: str, role: str, handle: Any) -> ActorInfo:
            tail: deque[str] = deque(maxlen=cfg.run.ray.log_tail_lines)
            log_file = self.run_dir / "logs" / "actors" / f"{name}.log"
            return ActorInfo(name, f"verst-{self.tag}-{name}", role, handle, log_file, tail)

        n = len(plan.train)
        for rank, slot in enumerate(plan.train):
            name = f"train-{rank}"
            handle = (
                ray.remote(TrainActor)
                .options(**options(name, slot))
                .remote(name, cfg, env_vars, str(self.run_dir), **common)
            )
            self.train_actors.append(info(name, f"train rank {rank} of {n}", handle))
        handle = (
            ray.remote(RolloutManagerActor)
            .options(**options("rollout", plan.rollout))
            .remote("rollout", cfg, env_vars, str(self.run_dir), **common)
        )
        self.rollout_actor = info("rollout", f"rollout manager, {plan.layout}", handle)
        for i, slot in enumerate(plan.engines):
            name = f"engine-{i}"
            handle = (
                ray.remote(EngineActor)
                .options(**options(name, slot))
                .remote(name, cfg, env_vars, str(self.run_dir), **common)
            )
            self.engine_actors.append(info(name, f"engine actor {i} of {len(plan.engines)}", handle))
        for actor, desc in zip(self.actors, self.call(self.actors, "describe"), strict=True):
            actor.where = f"pid {desc['pid']}, node {desc['node_ip']}"
        addr, port = self.call(self.train_actors[:1], "rendezvous")[0]
        calls = [
            (actor, "setup", (rank, n, addr, port, model_path))
            for rank, actor in enumerate(self.train_actors)
        ]
        calls += [(actor, "setup", (model_path,)) for actor in self.engine_actors]
        handles = [(a.handle, a.name) for a in self.engine_actors]
        calls.append((self.rollout_actor, "setup", (model_path, plan.layout == "colocated", handles)))
        *_, rollout_info = self.call_each(calls)
        self.rollout._set_info(rollout_info)

    @property
    def actors(self) -> list[ActorInfo]:
        """Every live actor record (train ranks, the rollout manager, the engine actors)."""
        return self.train_actors + ([self.rollout_actor] if self.rollout_actor else []) + self.engine_actors

    # ------------------------------------------------------------ calls

    def call(self, actors: Sequence[ActorInfo], method: str, *args: Any, fetch: bool = True) -> list[Any]:
        """`method(*args)` on every actor at once; results in order (ObjectRefs when not `fetch`)."""
        return self.call_each([(a, method, args) for a in actors], fetch=fetch)

    def call_each(
        self, calls: Sequence[tuple[ActorInfo, str, tuple[Any, ...]]], *, fetch: bool = True
    ) -> list[Any]:
        """Several (actor, method, args) at once; the first failure tears everything down and raises."""
        if self.closed:
            raise RuntimeError("the Ray placement of this run is closed (an actor failed, or the run ended)")
        ray = require_ray()
        results, pending = [], {}
        for actor, method, args in calls:
            result_ref, logs_ref = actor.handle.call.options(num_returns=2).remote(method, *args)
            results.append(result_ref)
            pending[logs_ref] = (actor, method)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                actor, method = pending.pop(ref)
                try:
                    actor.tail.extend(ray.get(ref))
                except ray.exceptions.RayActorError as exc:
                    self.abort()
                    raise self._died(actor, method, exc) from None
                except Exception as exc:
                    # a peer's death often shows first as a collective error on a live rank:
                    # report the dead actor (the cause) when there is one
                    dead = self._find_dead(ray, pending)
                    self.abort()
                    exc.add_note(
                        f"raised in Ray actor '{actor.name}' ({actor.role}, {actor.where}) during {method}"
                    )
                    if dead is not None:
                        (dead_actor, dead_method), died = dead
                        raise self._died(dead_actor, dead_method, died) from exc
                    raise
        return ray.get(results) if fetch else results

    def _find_dead(self, ray: Any, pending: dict[Any, tuple[ActorInfo, str]]) -> Any:
        """Among the calls still pending, one whose actor died (waiting up to PEER_DEATH_WAIT_S)."""
        if not pending:
            return None
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=PEER_DEATH_WAIT_S)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as died:
                return pending[ref], died
            except Exception:
                continue
        return None

    def _died(self, actor: ActorInfo, method: str, exc: BaseException) -> ActorDiedError:
        n = self.config.run.ray.log_tail_lines
        lines = _read_tail(actor.log_file, n)
        source = str(actor.log_file)
        if not lines:
            lines, source = list(actor.tail)[-n:], "as last received by the driver"
        reason = " ".join(str(exc).split())[:600]
        ckpt = latest_checkpoint(self.run_dir / "checkpoints")
        quoted = "\n".join(f"    {line}" for line in lines) or "    (no log lines)"
        message = (
            f"Ray actor '{actor.name}' ({actor.role}; Ray name '{actor.ray_name}', {actor.where}) died "
            f"during {method}: {reason}\n"
            f"Last {len(lines)} log lines of '{actor.name}' ({source}):\n{quoted}\n"
            f"The run stopped and its actors were shut down. Newest checkpoint: "
            f"{ckpt if ckpt else 'none yet'}; run the same command again to resume from it "
            "(run.resume=true, the default)."
        )
        return ActorDiedError(message, actor=actor.name, method=method, log_lines=lines)

    # ------------------------------------------------------------ teardown

    def abort(self) -> None:
        """Kill every actor and free the placement group now (after a failure)."""
        if self.closed:
            return
        self.closed = True
        ray = require_ray()
        for actor in self.actors:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(actor.handle, no_restart=True)
        self._release_cluster(ray)

    def close_rollout(self, close_engine: bool) -> None:
        """Politely close the rollout manager (strategy state, engines), then end it (and the
        engine actors, when `close_engine`)."""
        if self.closed or self.rollout_actor is None:
            return
        actor, self.rollout_actor = self.rollout_actor, None
        self._close_actors([(actor, (close_engine,))])
        if close_engine and self.engine_actors:
            engines, self.engine_actors = self.engine_actors, []
            self._close_actors([(a, ()) for a in engines])

    def close(self) -> None:
        """Politely close every remaining actor, end them, free the bundles, leave Ray."""
        if self.closed:
            return
        calls = [(a, ()) for a in self.train_actors]
        if self.rollout_actor is not None:
            calls.append((self.rollout_actor, (True,)))
        self._close_actors(calls)
        self._close_actors([(a, ()) for a in self.engine_actors])  # after the rollout manager
        self.closed = True
        self._release_cluster(require_ray())

    def _close_actors(self, calls: list[tuple[ActorInfo, tuple[Any, ...]]]) -> None:
        ray = require_ray()
        refs = [a.handle.call.options(num_returns=2).remote("close", *args)[1] for a, args in calls]
        ray.wait(refs, num_returns=len(refs), timeout=CLOSE_TIMEOUT_S)
        for actor, _ in calls:
            with contextlib.suppress(Exception):
                ray.kill(actor.handle, no_restart=True)

    def _release_cluster(self, ray: Any) -> None:
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
            self.pg = None
        self.conn.close()


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

    def state_dict_for_sync(self) -> RemoteStateDict:
        """Gather the full weights (a collective over the ranks); they stay in the object store."""
        refs = self._p.call(self._p.train_actors, "state_dict_for_sync", fetch=False)
        nbytes = self._p.call(self._p.train_actors[:1], "state_nbytes")[0]
        return RemoteStateDict(refs[0], nbytes)

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
        self.info: dict[str, Any] = {}
        """Everything the rollout manager reported after setup."""
        self.sink: LifecycleSink | None = None
        """Where the rollout manager's lifecycle events go (the driver's `lifecycle.jsonl`)."""

    def _set_info(self, info: dict[str, Any]) -> None:
        self.info = dict(info)
        self.has_eval = bool(info["has_eval"])
        self.engine_capabilities = info["engine_capabilities"]
        self.strategy_path = str(info["strategy_path"])

    def _call(self, method: str, *args: Any) -> Any:
        actor = self._p.rollout_actor
        if actor is None:
            raise RuntimeError("the rollout manager is closed")
        return self._p.call([actor], method, *args)[0]

    def _relay_events(self) -> None:
        """Write the lifecycle events the rollout manager buffered since the last call."""
        if self.sink is not None:
            for event in self._call("drain_events"):
                self.sink.emit(event)

    def rollout(self, rollout_id: int, weight_version: int) -> Any:
        result = self._call("rollout", rollout_id, weight_version)
        self._relay_events()
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
