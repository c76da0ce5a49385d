"""vLLM's runtime LoRA API on the client side (mixed into `VllmClient`), as vllm 0.32 has it.

    POST /v1/load_lora_adapter    {lora_name, lora_path, load_inplace}   → 200 text / ErrorResponse
    POST /v1/unload_lora_adapter  {lora_name}
    /inference/v1/generate        "model": <lora_name> routes a request to that adapter

The server needs `--enable-lora --max-lora-rank R --max-loras N` and the environment variable
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (`vllm/entrypoints/serve/lora/api_router.py`). An
adapter refit is pause → load in place (`load_inplace: true` replaces a loaded name, and loads a
new one) → `/update_weight_version` → reset the prefix cache → resume, checked like a full refit.
vLLM has no route that takes adapter tensors: `load_lora_adapter_from_tensors` writes a PEFT
directory (`adapter_model.safetensors` + `adapter_config.json`) and loads that.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from verst.rollout.engines.common.lora import AdapterFiles, AdapterLoading, AdapterSource, jsonable_config


class VllmLoraMixin(AdapterLoading):
    """`load_lora_adapter`, `load_lora_adapter_from_tensors`, `unload_lora_adapter`."""

    _call: Callable[..., Awaitable[Any]]
    _paused_refit: Callable[..., Awaitable[int]]
    get_weight_version: Callable[[], Awaitable[int]]
    _tensor_adapter_dirs: dict[str, Path]

    async def _load_adapter(self, lora_name: str, source: AdapterSource, weight_version: int | None) -> int:
        """From a PEFT directory the server can read (version: `weight_version`, or the current
        one when None); tensors are written as an adapter directory first (same host only)."""
        if isinstance(source, AdapterFiles):

            async def load() -> None:
                body = {"lora_name": lora_name, "lora_path": source.path, "load_inplace": True}
                await self._call("POST", "/v1/load_lora_adapter", body)

            version = await self.get_weight_version() if weight_version is None else weight_version
            return await self._paused_refit("load_lora_adapter", version, load)
        from safetensors.torch import save_file

        folder = Path(tempfile.mkdtemp(prefix=f"verst-vllm-lora-{lora_name}-"))
        state = {n: t.detach().cpu().contiguous() for n, t in source.tensors.items()}
        await asyncio.to_thread(save_file, state, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps(jsonable_config(source.config)))
        version = await self._load_adapter(lora_name, AdapterFiles(str(folder)), weight_version)
        # vLLM may re-read an evicted adapter from its folder: keep it until it is replaced
        previous = self._tensor_adapter_dirs.pop(lora_name, None)
        self._tensor_adapter_dirs[lora_name] = folder
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        return version

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Unload an adapter (requests naming it then fail with 404)."""
        await self._call("POST", "/v1/unload_lora_adapter", {"lora_name": lora_name})
