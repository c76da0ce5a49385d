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

The proxies themselves (`TrainProxy`, `RolloutProxy`, `RemoteStateDict`) are in `side_proxies`.
"""

from __future__ import annotations

import contextlib
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
from verst.trainer.placement.side_proxies import RolloutProxy, TrainProxy
from verst.trainer.run.checkpoint import latest_checkpoint

PLACEMENT_GROUP_TIMEOUT_S = 300.0
"""How long to wait for the cluster to grant the train placement group."""
CLOSE_TIMEOUT_S = 60.0
"""How long a polite close of the actors may take before they are killed."""
POLL_S = 0.1
"""How often a call that can be stopped (the rollout) checks the driver's stop request."""
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
        """Reserve the train bundles, start every actor, then build them all at once."""
        self._reserve_bundles(ray)
        self._spawn_actors(ray, actor_env_vars(env, self.config.run.env))
        for actor, desc in zip(self.actors, self.call(self.actors, "describe"), strict=True):
            actor.where = f"pid {desc['pid']}, node {desc['node_ip']} ({desc['node_id'][:8]})"
        self._setup_actors(model_path)

    def _reserve_bundles(self, ray: Any) -> None:
        from ray.util.placement_group import placement_group

        bundles = self.plan.bundles
        self.pg = placement_group(bundles, strategy="PACK", name=f"verst-{self.tag}-train")
        ready, _ = ray.wait([self.pg.ready()], timeout=PLACEMENT_GROUP_TIMEOUT_S)
        if not ready:
            raise RuntimeError(
                f"the Ray cluster did not grant the train bundles {bundles} within "
                f"{PLACEMENT_GROUP_TIMEOUT_S:.0f} s (cluster resources: {ray.cluster_resources()}); "
                "lower run.ray.num_train_actors / cpus_per_train_actor, or add nodes"
            )

    def _actor_options(self, name: str, slot: Any, env_vars: Mapping[str, str]) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

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

    def _spawn_actors(self, ray: Any, env_vars: Mapping[str, str]) -> None:
        """Start the train ranks, the rollout manager and the engine actors (light constructors)."""
        from verst.trainer.placement.actors import CONTROL_GROUP, RolloutManagerActor, TrainActor
        from verst.trainer.placement.engine_actors import EngineActor

        cfg, plan = self.config, self.plan
        common = {"log_lines": cfg.run.ray.log_tail_lines, "sys_path": [p for p in sys.path if p]}

        def start(cls: type, name: str, role: str, slot: Any, **remote: Any) -> ActorInfo:
            actor_cls = ray.remote(**remote)(cls) if remote else ray.remote(cls)  # not settable in options()
            options = self._actor_options(name, slot, env_vars)
            handle = actor_cls.options(**options).remote(name, cfg, env_vars, str(self.run_dir), **common)
            log_file = self.run_dir / "logs" / "actors" / f"{name}.log"
            tail: deque[str] = deque(maxlen=cfg.run.ray.log_tail_lines)
            return ActorInfo(name, f"verst-{self.tag}-{name}", role, handle, log_file, tail)

        n = len(plan.train)
        for rank, slot in enumerate(plan.train):
            self.train_actors.append(start(TrainActor, f"train-{rank}", f"train rank {rank} of {n}", slot))
        self.rollout_actor = start(
            RolloutManagerActor,
            "rollout",
            f"rollout manager, {plan.layout}",
            plan.rollout,
            concurrency_groups={CONTROL_GROUP: 1},  # `interrupt` runs there, beside a rollout
        )
        for i, slot in enumerate(plan.engines):
            role = f"engine actor {i} of {len(plan.engines)}"
            self.engine_actors.append(start(EngineActor, f"engine-{i}", role, slot))

    def _setup_actors(self, model_path: str) -> None:
        """Build every side at once: the train ranks rendezvous on rank 0's address."""
        assert self.rollout_actor is not None
        n = len(self.train_actors)
        addr, port = self.call(self.train_actors[:1], "rendezvous")[0]
        calls = [
            (actor, "setup", (rank, n, addr, port, model_path))
            for rank, actor in enumerate(self.train_actors)
        ]
        calls += [(actor, "setup", (model_path,)) for actor in self.engine_actors]
        handles = [(a.handle, a.name) for a in self.engine_actors]
        calls.append((self.rollout_actor, "setup", (model_path, self.plan.layout == "colocated", handles)))
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
        self,
        calls: Sequence[tuple[ActorInfo, str, tuple[Any, ...]]],
        *,
        fetch: bool = True,
        while_waiting: Callable[[], None] | None = None,
    ) -> list[Any]:
        """Several (actor, method, args) at once; the first failure tears everything down and raises.

        `while_waiting` is called every `POLL_S` while the calls run (the rollout's stop check)."""
        if self.closed:
            raise RuntimeError("the Ray placement of this run is closed (an actor failed, or the run ended)")
        ray = require_ray()
        results, pending = [], {}
        for actor, method, args in calls:
            result_ref, logs_ref = actor.handle.call.options(num_returns=2).remote(method, *args)
            results.append(result_ref)
            pending[logs_ref] = (actor, method)
        while pending:
            timeout = None if while_waiting is None else POLL_S
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            if not ready and while_waiting is not None:
                while_waiting()
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
        """Among the calls still pending, one whose actor died (waiting up to PEER_DEATH_WAIT_S).

        Two signs count, whichever comes first: a pending call failing with `RayActorError`, or
        the actor's name leaving the cluster's named actors (the GCS marks a killed actor dead
        before its callers' refs resolve, sometimes by many seconds on a busy machine)."""
        if not pending:
            return None
        deadline = time.monotonic() + PEER_DEATH_WAIT_S
        while True:
            wait_s = min(POLL_S * 5, max(0.0, deadline - time.monotonic()))
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=wait_s)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as died:
                    return pending[ref], died
                except Exception:
                    continue
            listed = ray.util.list_named_actors(all_namespaces=True)
            alive = {(a["namespace"], a["name"]) for a in listed}
            for actor, method in pending.values():
                if (self.namespace, actor.ray_name) not in alive:
                    gone = RuntimeError("the cluster no longer lists the actor as alive (killed or lost)")
                    return (actor, method), gone
            if len(ready) == len(pending) or time.monotonic() >= deadline:
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
