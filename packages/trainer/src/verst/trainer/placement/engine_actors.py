"""Embedded engines as their own Ray actors (`run.ray.engine_actors = N`).

`EngineActor` wraps one engine built from `[engine]` (one whose capabilities allow engine
actors: the embedded engine) in a Ray async actor
(its methods mirror the `InferenceEngine` protocol, plus memory release/resume and `stats`);
`ActorEngine` is the client inside the rollout manager: an `InferenceEngine` that awaits the
actor's ObjectRefs. The rollout manager puts its N clients in an `EnginePool`, so strategies
see one engine, exactly as with in-process engines.

The driver owns the engine actors (it starts, builds and ends them with the others); closing an
`ActorEngine` only stops using it. Like every verst actor, an engine actor answers the driver
through `call` (result plus new log lines) and logs to `<run_dir>/logs/actors/engine-<i>.log`.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from typing import Any

from verst.rollout.engine import GenerateOutput, GenerateRequest, engine_capabilities
from verst.trainer.placement.actor_engine import ActorEngine
from verst.trainer.placement.actors import ActorBase

__all__ = ["ActorEngine", "EngineActor"]


class EngineActor(ActorBase):
    """One embedded engine in its own process (a Ray async actor)."""

    role = "engine"

    def _init_engine_state(self) -> None:
        if not hasattr(self, "_ready"):
            self._ready = asyncio.Event()
            self.engine: Any = None
            self.requests = 0
            """`generate` calls served so far."""

    async def call(self, method: str, *args: Any) -> tuple[Any, list[str]]:  # type: ignore[override]
        """Run one method (awaited when async); returns its result and the new log lines."""
        try:
            result = getattr(self, method)(*args)
            if inspect.isawaitable(result):
                result = await result
        except BaseException:
            self.log.exception("%s: failed", method)
            raise
        return result, self.handler.drain()

    async def setup(self, model_path: str) -> dict[str, Any]:
        """Build one engine from `[engine]` (validated to be one that runs as an engine actor,
        with one copy); the engine then serves."""
        self._init_engine_state()
        ec = self.config.engine.with_model_path(model_path)
        self.engine = await ec.build(max_concurrency=self.config.rollout.max_concurrency)
        device = "gpu" if engine_capabilities(self.engine).uses_gpu else "cpu"
        self._ready.set()
        self.log.info("engine ready: %s on %s", ec.model_path, device)
        return {"name": self.name, "device": device}

    async def _engine(self) -> Any:
        self._init_engine_state()
        await self._ready.wait()
        return self.engine

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        engine = await self._engine()
        self.requests += 1
        return await engine.generate(request)

    async def abort(self, rid_prefix: str | None = None) -> None:
        await (await self._engine()).abort(rid_prefix)

    async def update_weights_from_tensors(
        self, named_tensors: dict[str, Any], weight_version: int | None = None
    ) -> int:
        return await (await self._engine()).update_weights_from_tensors(named_tensors, weight_version)

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> int:
        return await (await self._engine()).update_weights_from_disk(model_path, weight_version)

    async def health(self) -> bool:
        return await (await self._engine()).health()

    async def get_weight_version(self) -> int:
        return await (await self._engine()).get_weight_version()

    async def release_memory(self) -> None:
        await (await self._engine()).release_memory()

    async def resume_memory(self) -> None:
        await (await self._engine()).resume_memory()

    async def stats(self) -> dict[str, Any]:
        """Requests served, weight version, memory state, pid (diagnostics and tests)."""
        engine = await self._engine()
        return {
            "name": self.name,
            "requests": self.requests,
            "weight_version": engine.weight_version,
            "released": engine.released,
            "pid": os.getpid(),
        }

    async def close(self) -> None:
        """Stop the engine (queued requests end with `abort`)."""
        self._init_engine_state()
        if self.engine is not None:
            await self.engine.close()
        self.handler.close()
