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

from verst.rollout.engine import EngineError, GenerateOutput, GenerateRequest, InferenceEngine


class EnginePool:
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

    async def health(self) -> bool:
        return all(await asyncio.gather(*(e.health() for e in self.engines)))

    async def get_weight_version(self) -> int:
        """The highest version any engine reports."""
        return max(await asyncio.gather(*(e.get_weight_version() for e in self.engines)))

    async def release_memory_occupation(self) -> None:
        """Every engine that can frees its device memory (colocated training); others are skipped."""
        hooks = [getattr(e, "release_memory_occupation", None) for e in self.engines]
        await self._all("release_memory_occupation", [h() for h in hooks if h is not None])

    async def resume_memory_occupation(self) -> None:
        """Every engine that can takes back what `release_memory_occupation` freed."""
        hooks = [getattr(e, "resume_memory_occupation", None) for e in self.engines]
        await self._all("resume_memory_occupation", [h() for h in hooks if h is not None])

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
