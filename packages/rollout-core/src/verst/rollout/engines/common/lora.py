"""LoRA pieces every engine and client shares: a PEFT config made JSON-safe (what SGLang's
`/load_lora_adapter_from_tensors` and `verst serve` read), `AdapterLoading` (the two load calls
of `LoraAdapterServer` as one hook, so an engine writes one loader for both sources), and
`DefaultAdapterEngine`, the view of any engine whose requests use the trained adapter unless they
name one.
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


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterFiles:
    """An adapter as a PEFT directory the engine can read (`adapter_model.safetensors` + config)."""

    path: str

    async def load_into(self, engine: Any, lora_name: str, weight_version: int | None) -> int:
        """`engine.load_lora_adapter` of this directory."""
        return await engine.load_lora_adapter(lora_name, self.path, weight_version=weight_version)


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterTensors:
    """An adapter as PEFT-named tensors and its PEFT config dict."""

    tensors: dict[str, Any]
    config: dict[str, Any]

    async def load_into(self, engine: Any, lora_name: str, weight_version: int | None) -> int:
        """`engine.load_lora_adapter_from_tensors` of these tensors."""
        return await engine.load_lora_adapter_from_tensors(
            lora_name, self.tensors, self.config, weight_version=weight_version
        )


AdapterSource = AdapterFiles | AdapterTensors


class AdapterLoading:
    """`LoraAdapterServer`'s loads (`verst.rollout.engine`) on top of one `_load_adapter` hook."""

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, *, weight_version: int | None = None
    ) -> int:
        """Load (or replace) an adapter from a PEFT directory; returns the weight version."""
        return await self._load_adapter(lora_name, AdapterFiles(str(lora_path)), weight_version)

    async def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        tensors: dict[str, Any],
        config_dict: dict[str, Any],
        *,
        weight_version: int | None = None,
    ) -> int:
        """Load (or replace) an adapter from PEFT-named tensors; returns the weight version."""
        return await self._load_adapter(lora_name, AdapterTensors(tensors, config_dict), weight_version)

    async def _load_adapter(self, lora_name: str, source: AdapterSource, weight_version: int | None) -> int:
        """Load (or replace) `lora_name` from `source`, labelled `weight_version` (None: keep the
        current one); returns the weight version."""
        raise NotImplementedError(f"{type(self).__name__}._load_adapter")


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
