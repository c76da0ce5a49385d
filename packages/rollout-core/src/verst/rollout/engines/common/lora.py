"""LoRA pieces every engine and client shares: a PEFT config made JSON-safe (what SGLang's
`/load_lora_adapter_from_tensors` and `verst serve` read), and `DefaultAdapterEngine`, the view of
any engine whose requests use the trained adapter unless they name one.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any


def jsonable_config(config: dict[str, Any]) -> dict[str, Any]:
    """A PEFT config dict made JSON-safe (PEFT keeps `target_modules` as a set)."""
    return json.loads(
        json.dumps(config, default=lambda o: sorted(o) if isinstance(o, set | frozenset) else str(o))
    )


class DefaultAdapterEngine:
    """An engine view whose requests use `adapter` unless they name one (the trained policy's).

    The rollout strategy gets this view when `[train.lora]` is on; weight sync keeps talking to
    the engine itself. Everything but `generate`/`generate_batch` passes straight through.
    """

    def __init__(self, engine: Any, adapter: str) -> None:
        self.engine = engine
        self.adapter = adapter

    def _route(self, request: Any) -> Any:
        return (
            request if request.lora_path is not None else dataclasses.replace(request, lora_path=self.adapter)
        )

    async def generate(self, request: Any) -> Any:
        return await self.engine.generate(self._route(request))

    async def generate_batch(self, requests: list[Any]) -> list[Any]:
        return await self.engine.generate_batch([self._route(r) for r in requests])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)
