"""`EnginePool`: several engines behind one `InferenceEngine`.

Requests go to the engine with the fewest requests in flight (round-robin among ties); aborts
and weight updates fan out to every engine, and a failure on any of them is raised. Resources
the pool owns (e.g. launched server processes) are released by `close()`.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from verst.rollout.engine import (
    EngineCapabilities,
    EngineError,
    EngineTimeout,
    GenerateOutput,
    GenerateRequest,
    InferenceEngine,
    MemoryReleasable,
    engine_capabilities,
)
from verst.rollout.engines.common.lora import AdapterFiles, AdapterLoading, AdapterSource


class EnginePool(AdapterLoading):
    """Load-balances requests over engines implementing `InferenceEngine`."""

    def __init__(
        self, engines: Sequence[InferenceEngine], *, on_close: Sequence[Callable[[], Any]] = ()
    ) -> None:
        """`on_close`: callables run after the engines are closed (sync or async)."""
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        self.engines = list(engines)
        self._inflight = [0] * len(self.engines)
        self._rr = itertools.count()
        self._on_close = list(on_close)

    @property
    def capabilities(self) -> EngineCapabilities:
        """What every engine of the pool can do (weight-sync modes all accept, in the first
        engine's order of preference)."""
        caps = [engine_capabilities(e) for e in self.engines]
        modes = tuple(m for m in caps[0].weight_sync if all(m in c.weight_sync for c in caps))
        counts = [c.engine_count for c in caps]
        return EngineCapabilities(
            in_process=all(c.in_process for c in caps),
            uses_gpu=any(c.uses_gpu for c in caps),
            needs_model_path=any(c.needs_model_path for c in caps),
            weight_sync=modes,
            release_memory=any(c.release_memory for c in caps),
            engine_count=None if None in counts else sum(counts),  # type: ignore[arg-type]
            lora=all(c.lora for c in caps),
            weight_dtype=caps[0].weight_dtype if len({c.weight_dtype for c in caps}) == 1 else None,
            partial_weights=all(c.partial_weights for c in caps),
        )

    def _pick(self) -> int:
        low = min(self._inflight)
        ties = [i for i, n in enumerate(self._inflight) if n == low]
        return ties[next(self._rr) % len(ties)]

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        i = self._pick()
        self._inflight[i] += 1
        try:
            return await self.engines[i].generate(request)
        finally:
            self._inflight[i] -= 1

    async def _all(self, what: str, calls: list[Any]) -> list[Any]:
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [f"engine {i}: {r}" for i, r in enumerate(results) if isinstance(r, BaseException)]
        for r in results:
            if isinstance(r, EngineTimeout):  # its one line names the engine, the route and the bound
                raise r
        if errors:
            raise EngineError(
                f"{what} failed on {len(errors)} of {len(results)} engines: {'; '.join(errors)}"
            )
        return results

    async def abort(self, rid_prefix: str | None = None) -> None:
        await self._all("abort", [e.abort(rid_prefix) for e in self.engines])

    async def update_weights_from_tensors(
        self, named_tensors: dict[str, Any], weight_version: int | None = None
    ) -> int:
        if weight_version is None:
            weight_version = await self.get_weight_version() + 1
        versions = await self._all(
            "update_weights_from_tensors",
            [e.update_weights_from_tensors(named_tensors, weight_version) for e in self.engines],
        )
        return _same(versions)

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> int:
        if weight_version is None:
            weight_version = await self.get_weight_version() + 1
        versions = await self._all(
            "update_weights_from_disk",
            [e.update_weights_from_disk(model_path, weight_version) for e in self.engines],
        )
        return _same(versions)

    async def _load_adapter(self, lora_name: str, source: AdapterSource, weight_version: int | None) -> int:
        """Load (or replace) the adapter on every engine, from the same source."""
        calls = [source.load_into(e, lora_name, weight_version) for e in self.engines]
        what = "load_lora_adapter" if isinstance(source, AdapterFiles) else "load_lora_adapter_from_tensors"
        return _same(await self._all(what, calls))

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Unload an adapter from every engine."""
        await self._all("unload_lora_adapter", [e.unload_lora_adapter(lora_name) for e in self.engines])

    async def health(self) -> bool:
        return all(await asyncio.gather(*(e.health() for e in self.engines)))

    async def get_weight_version(self) -> int:
        """The highest version any engine reports."""
        return max(await asyncio.gather(*(e.get_weight_version() for e in self.engines)))

    async def reported_weight_dtype(self) -> str | None:
        """The engines' common weight dtype (None when they differ or one does not say)."""
        from verst.rollout.engines.common.replicas import reported_weight_dtype

        dtypes = set(await asyncio.gather(*(reported_weight_dtype(e) for e in self.engines)))
        return dtypes.pop() if len(dtypes) == 1 else None

    async def replica_states(self) -> list[tuple[Any, ...]]:
        """Every engine's replicas, each under its engine's index (`common.replicas`)."""
        from verst.rollout.engines.common.replicas import replica_states

        states = await asyncio.gather(*(replica_states(e) for e in self.engines))
        return [(i, *r) for i, rs in enumerate(states) for r in rs]

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Every engine that can frees its device memory (`tags`: SGLang's; None = all); others
        are skipped."""
        hooks = [e.release_memory_occupation(tags) for e in self.engines if isinstance(e, MemoryReleasable)]
        await self._all("release_memory_occupation", hooks)

    async def resume_memory_occupation(
        self, tags: list[str] | None = None, *, continue_generation: bool = True
    ) -> None:
        """Every engine that can takes back `tags` (None = all) of what it released."""
        hooks = [
            e.resume_memory_occupation(tags, continue_generation=continue_generation)
            for e in self.engines
            if isinstance(e, MemoryReleasable)
        ]
        await self._all("resume_memory_occupation", hooks)

    async def close(self) -> None:
        try:
            await asyncio.gather(*(e.close() for e in self.engines), return_exceptions=True)
        finally:
            for fn in self._on_close:
                result = fn()
                if asyncio.iscoroutine(result):
                    await result


def _same(versions: list[int]) -> int:
    if len(set(versions)) != 1:
        raise EngineError(f"engines disagree on the weight version after an update: {versions}")
    return versions[0]
