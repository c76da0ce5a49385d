"""`ActorEngine`: the rollout manager's client of one engine actor (`engine_actors.EngineActor`).

An `InferenceEngine` that awaits the actor's ObjectRefs; the rollout manager puts its clients in
an `EnginePool`. It lives apart from the actor classes so that the rollout manager
(`placement.actors`) imports it without importing `engine_actors`, which builds on `actors`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from verst.rollout.engine import EngineCapabilities, GenerateOutput, GenerateRequest


class ActorEngine:
    """An `InferenceEngine` whose engine is an `EngineActor` (awaits its ObjectRefs)."""

    capabilities = EngineCapabilities(weight_sync=("tensors", "disk"), release_memory=True)
    """Out of process, but weights go over as tensors (through Ray's object store)."""

    def __init__(self, handle: Any, name: str = "engine") -> None:
        self.handle = handle
        """The Ray actor handle."""
        self.name = name
        """The actor's short name (for messages)."""

    async def _await(self, ref: Any) -> Any:
        try:
            return await ref
        except asyncio.CancelledError:
            import ray

            ray.cancel(ref)  # cancels the actor's coroutine: the engine aborts the request
            raise

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        return await self._await(self.handle.generate.remote(request))

    async def abort(self, rid_prefix: str | None = None) -> None:
        await self.handle.abort.remote(rid_prefix)

    async def update_weights_from_tensors(
        self, named_tensors: dict[str, Any], weight_version: int | None = None
    ) -> int:
        return await self.handle.update_weights_from_tensors.remote(named_tensors, weight_version)

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> int:
        return await self.handle.update_weights_from_disk.remote(model_path, weight_version)

    async def health(self) -> bool:
        try:
            return bool(await self.handle.health.remote())
        except Exception:  # a dead actor is an unhealthy engine
            return False

    async def get_weight_version(self) -> int:
        return await self.handle.get_weight_version.remote()

    async def release_memory_occupation(self) -> None:
        """Free the actor's device memory (colocated training)."""
        await self.handle.release_memory.remote()

    async def resume_memory_occupation(self) -> None:
        """Take back what `release_memory_occupation` freed."""
        await self.handle.resume_memory.remote()

    async def close(self) -> None:
        """Nothing: the driver owns (and ends) the engine actors."""
