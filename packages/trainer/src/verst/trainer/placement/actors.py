"""The Ray actors: `TrainActor` (one `TrainSide` rank) and `RolloutManagerActor` (the `RolloutSide`).

They are plain classes made remote by `proxies.RayPlacement` (`ray.remote(cls).options(...)`), so
this module imports no Ray at module level. Construction is light (logging, import path, the
effective environment); `setup` builds the heavy side, so the driver can start every actor
first and then build them all at once (the train ranks must rendezvous together).

Every actor logs to a ring buffer and to `<run_dir>/logs/actors/<name>.log`. Each driver call
goes through `call(method, *args)`, which returns `(result, new log lines)`: the driver keeps the
recent lines of every actor, so when an actor dies it can quote them even without a shared
filesystem.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verst.rollout.engine import MemoryReleasable
from verst.rollout.selection import LEGACY_FLAG, resolve_strategy_path
from verst.trainer.config import RunConfig

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""Format of an actor's log lines."""
CONTROL_GROUP = "control"
"""The rollout manager's second concurrency group (one thread): `interrupt` runs there while a
rollout runs in the default group (which stays one thread, its calls in order)."""


@dataclass(frozen=True)
class RolloutStopped:
    """What `RolloutManagerActor.rollout` returns when `interrupt` stopped it: a value, not an
    exception (an exception fails the call and tears the placement down). The driver raises
    `RolloutInterrupted` with `message`."""

    message: str


class RingLogHandler(logging.Handler):
    """Keeps the last lines (and the lines not yet sent to the driver) and appends to a file."""

    def __init__(self, maxlen: int, path: Path | None) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter(LOG_FORMAT))
        self.recent: deque[str] = deque(maxlen=maxlen)
        """The newest lines."""
        self._unsent: deque[str] = deque(maxlen=maxlen)
        self._guard = threading.Lock()
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", buffering=1, encoding="utf-8")

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # a broken record must not take the actor down
            line = f"<unformattable log record from {record.name}>"
        with self._guard:
            self.recent.append(line)
            self._unsent.append(line)
            if self._file is not None and not self._file.closed:
                self._file.write(line + "\n")

    def drain(self) -> list[str]:
        """The lines logged since the last drain."""
        with self._guard:
            out = list(self._unsent)
            self._unsent.clear()
        return out

    def close(self) -> None:
        with self._guard:
            if self._file is not None:
                self._file.close()
        super().close()


class ActorBase:
    """What every verst actor has: a name, the effective env, its log, `call` and `apply`."""

    role = "actor"

    def __init__(
        self,
        name: str,
        config: RunConfig,
        env: Mapping[str, str],
        run_dir: str,
        *,
        log_lines: int,
        sys_path: list[str],
    ) -> None:
        """`env` is the effective environment the driver resolved (also this actor's runtime env);
        `sys_path` the driver's import path (entries that exist here and are missing are appended,
        so user modules next to the config import in the actor too)."""
        self.name = name
        self.config = config
        self.env = dict(env)
        self.run_dir = Path(run_dir)
        for entry in sys_path:
            if entry and entry not in sys.path and os.path.isdir(entry):
                sys.path.append(entry)
        self.handler = RingLogHandler(log_lines, self.run_dir / "logs" / "actors" / f"{name}.log")
        root = logging.getLogger()
        root.addHandler(self.handler)
        console = logging.StreamHandler()
        console.setLevel(logging.WARNING)
        console.setFormatter(logging.Formatter(f"[{name}] " + LOG_FORMAT))
        root.addHandler(console)
        logging.getLogger("verst").setLevel(logging.INFO)
        logging.captureWarnings(True)
        self.log = logging.getLogger(f"verst.placement.{name}")
        self.log.info("%s started (pid %d)", name, os.getpid())

    def describe(self) -> dict[str, Any]:
        """Who and where this actor is, and what it resolves from its environment."""
        import ray
        from ray.util import get_node_ip_address

        node_id = ray.get_runtime_context().get_node_id()
        self.log.info("%s runs on node %s (%s)", self.name, node_id, get_node_ip_address())
        return {
            "name": self.name,
            "role": self.role,
            "pid": os.getpid(),
            "node_ip": get_node_ip_address(),
            "node_id": node_id,
            "legacy_flag": self.env.get(LEGACY_FLAG),
            "strategy_path": resolve_strategy_path(self.config.rollout, self.env),
        }

    def call(self, method: str, *args: Any) -> tuple[Any, list[str]]:
        """Run one method; returns its result and the log lines since the last call."""
        t0 = time.perf_counter()
        self.log.info("%s: start", method)
        try:
            result = getattr(self, method)(*args)
        except BaseException:
            self.log.exception("%s: failed", method)
            raise
        self.log.info("%s: done in %.3f s", method, time.perf_counter() - t0)
        return result, self.handler.drain()

    def apply(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(self, *args)` inside this actor (diagnostics and tests)."""
        return fn(self, *args)

    def log_tail(self) -> list[str]:
        """The newest log lines."""
        return list(self.handler.recent)


class TrainActor(ActorBase):
    """One train rank: a `TrainSide` in its own process; FSDP across all train actors."""

    role = "train"

    def rendezvous(self) -> tuple[str, int]:
        """(this node's IP, a free port): rank 0's answer is every rank's MASTER_ADDR/PORT."""
        from ray.util import get_node_ip_address

        from verst.trainer.placement.ray_cluster import free_port

        ip = get_node_ip_address()
        return ip, free_port(ip)

    def setup(self, rank: int, world_size: int, master_addr: str, master_port: int, model_path: str) -> dict:
        """Join the process group (when several ranks) and build the `TrainSide`."""
        rank_env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": "0",  # Ray shows each train actor only its own GPU
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
        }
        os.environ.update(rank_env)  # accelerate and NCCL read the process environment
        self.env.update(rank_env)
        from verst.trainer.train.side import TrainSide

        cfg = self.config
        self.log.info("rank %d of %d, rendezvous %s:%d", rank, world_size, master_addr, master_port)
        self.side = TrainSide(
            cfg.train,
            cfg.algorithm,
            model_path=model_path,
            total_steps=cfg.run.num_steps,
            max_response_len=cfg.rollout.max_response_len,
            temperature=cfg.rollout.temperature,
            env=self.env,
            opd=cfg.opd,
        )
        return {"rank": rank, "sharding": self.side.bundle.sharding}

    def train_step(self, batch: Any) -> dict[str, float]:
        metrics = self.side.train_step(batch)
        self.log.info(
            "train_step %d: loss %.4f", self.side.optimizer_steps, metrics.get("train/loss", float("nan"))
        )
        return metrics

    def step_detail(self) -> Any:
        return self.side.step_detail()

    def state_dict_for_sync(self, plan: Any = None) -> dict:
        return self.side.state_dict_for_sync(plan)

    def state_nbytes(self, plan: Any = None) -> int:
        return self.side.state_nbytes(plan)

    def static_names(self) -> tuple[frozenset[str], frozenset[str]]:
        return self.side.static_names()

    def save_hf(self, path: str, state_dict: dict | None) -> None:
        self.side.save_hf(path, state_dict)

    def save(self, path: str) -> None:
        self.side.save(path)

    def load(self, path: str) -> None:
        self.side.load(path)

    def close(self) -> None:
        """Release the model and leave the process group."""
        side = getattr(self, "side", None)
        if side is not None:
            side.close()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        self.handler.close()


class RolloutManagerActor(ActorBase):
    """The rollout side in its own process: strategy, data source, reward and engines.

    The engines are built from `[engine]` inside this actor: an embedded engine lives in it
    (or in `run.ray.engine_actors` engine actors it talks to); `sglang_launch` servers are
    started (and stopped) by it; `sglang` connects to running ones. Colocated, the engine gives
    its memory to the trainer after each rollout and takes it back around the refit, in SGLang's
    order (`verst.trainer.sync.colocate.ColocatedMemory`; a no-op for engines without the hooks).
    """

    role = "rollout"

    def setup(self, model_path: str, colocated: bool, engine_actors: list | None = None) -> dict:
        """Build the `RolloutSide` (engine, data, rewards, strategy); returns what the driver needs.

        `engine_actors`: (handle, name) of the run's engine actors; the engine is then an
        `EnginePool` of `ActorEngine` clients instead of one built here."""
        from verst.trainer.run.recording import BufferedSink
        from verst.trainer.run.rollout_side import RolloutSide

        engine = None
        if engine_actors:
            from verst.rollout.engines.pool import EnginePool
            from verst.trainer.placement.actor_engine import ActorEngine

            engine = EnginePool([ActorEngine(h, name) for h, name in engine_actors])
        self.sink = BufferedSink()  # the driver drains it into its lifecycle.jsonl (drain_events)
        self.side = RolloutSide(
            self.config, model_path=model_path, env=self.env, sink=self.sink, engine=engine,
            fresh_engine=engine is not None,  # the run's own engine actors, built from [engine]
        )  # fmt: skip
        from verst.trainer.sync.colocate import ColocatedMemory

        self.memory = ColocatedMemory(self.side.engine, self.side._run, colocated=colocated)
        strategy = type(self.side.strategy)
        info = {
            "has_eval": self.side.has_eval,
            # engine actors take tensors too (through Ray's object store): their capabilities say so
            "engine_capabilities": self.side.engine_capabilities,
            "engine_holds_model": self.side.engine_holds_model,
            "strategy_path": self.side.strategy_path,
            "strategy_class": f"{strategy.__module__}:{strategy.__qualname__}",
            "engine_can_release": isinstance(self.side.engine, MemoryReleasable),
        }
        self.log.info("rollout side ready: %s", info)
        return info

    interrupted: int | None = None
    """The rollout id `interrupt` asked to stop (an id, so a late interrupt stops no later rollout)."""

    def interrupt(self, rollout_id: int) -> None:
        """Stop rollout `rollout_id` (running, or about to run): its strategy aborts the engine
        requests in flight and hands its groups back; `rollout` then returns `RolloutStopped`.
        Called in the control group, while `rollout` runs."""
        self.log.info("interrupt: stopping rollout %d", rollout_id)
        self.interrupted = rollout_id

    def rollout(self, rollout_id: int, weight_version: int) -> Any:
        from verst.trainer.run.rollout_side import RolloutInterrupted

        self.memory.before_generate()
        try:
            result = self.side.rollout(
                rollout_id, weight_version, stop=lambda: self.interrupted == rollout_id
            )
        except RolloutInterrupted as exc:
            self.log.info("rollout %d: stopped (%s)", rollout_id, exc)
            return RolloutStopped(str(exc))
        self.log.info("rollout %d: %d groups", rollout_id, len(result.groups))
        self.memory.after_rollout()  # the train step and a refit follow
        return result

    def evaluate(self, rollout_id: int, weight_version: int) -> Any:
        self.memory.before_generate()
        return self.side.evaluate(rollout_id, weight_version)  # the next rollout uses these weights

    def update_weights_from_tensors(self, named_tensors: dict, weight_version: int) -> int:
        self.memory.before_refit()
        version = self.side.update_weights_from_tensors(named_tensors, weight_version)
        self.memory.after_refit()
        return version

    def update_weights_from_disk(self, path: str, weight_version: int) -> int:
        self.memory.before_refit()
        version = self.side.update_weights_from_disk(path, weight_version)
        self.memory.after_refit()
        return version

    def weight_version(self) -> int:
        return self.side.weight_version()

    def replica_states(self) -> list | None:
        """The engines' replicas (`RolloutSide.replica_states`); None while released weights
        wait for a refit (a refit then sends every tensor)."""
        if self.memory.weights_pending:
            return None
        return self.side.replica_states()

    def state_dict(self) -> dict:
        return self.side.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.side.load_state_dict(state)

    def drain_events(self) -> list:
        """The lifecycle events emitted since the last drain (the driver writes them)."""
        sink = getattr(self, "sink", None)
        return sink.drain() if sink is not None else []

    def _close_side(self, close_engine: bool) -> None:
        """Close the strategy (unfinished samples go back to the data source) and the engine,
        with the engine's memory taken back first (a closing strategy may still abort requests)."""
        side = getattr(self, "side", None)
        if side is None:
            return
        memory = getattr(self, "memory", None)
        if memory is not None and not memory.weights_pending:
            memory.before_generate()
        side.close(close_engine=close_engine)

    def close_side(self, close_engine: bool) -> list:
        """Close the rollout side (strategy, engine) and return its last lifecycle events."""
        self._close_side(close_engine)
        return self.drain_events()

    def close(self, close_engine: bool) -> None:
        """Close the strategy (unfinished samples go back to the data source), the engine, the sink."""
        try:
            self._close_side(close_engine)
        finally:
            sink = getattr(self, "sink", None)
            if sink is not None:
                sink.close()
            self.handler.close()
