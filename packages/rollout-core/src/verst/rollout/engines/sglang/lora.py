"""SGLang's LoRA API on the client side (mixed into `SGLangClient`), as SGLang 0.5.23 has it.

    POST /load_lora_adapter               {lora_name, lora_path, pinned?}
    POST /load_lora_adapter_from_tensors  {lora_name, config_dict, serialized_named_tensors: [b64], ...}
    POST /unload_lora_adapter             {lora_name}
    → {success, error_message, loaded_adapters: {name: path}} (HTTP 400 when success is false)
    POST /update_weight_version           {new_version: str, abort_all_requests: bool}
    /generate                             "lora_path": adapter name (or a list for a batch)

SGLang refuses to load a name that is already loaded, and its load endpoints carry no weight
version; so an adapter refit on each worker is pause → flush → load (when the name is taken:
unload, load again) → `/update_weight_version` → check `/model_info` → continue, the same
version check a full refit gets. The server must be launched with `--enable-lora` (and `--max-lora-rank`,
`--lora-target-modules` covering the adapter; `--max-loras-per-batch` for multi-LoRA).
"""

from __future__ import annotations

import base64
import pickle
from collections.abc import Awaitable, Callable
from typing import Any

from verst.rollout.engines.common.errors import InvalidRequest
from verst.rollout.engines.common.lora import AdapterFiles, AdapterLoading, AdapterSource, jsonable_config


def serialize_tensor_dict(tensors: dict[str, Any]) -> str:
    """base64 of a pickled `{name: tensor}` (SGLang's `MultiprocessingSerializer` payload for
    `/load_lora_adapter_from_tensors`; CUDA tensors go as IPC handles, same host only)."""
    if tensors and all(getattr(t, "is_cuda", False) for t in tensors.values()):
        import io

        from torch.multiprocessing.reductions import ForkingPickler

        buf = io.BytesIO()
        ForkingPickler(buf).dump(dict(tensors))
        return base64.b64encode(buf.getvalue()).decode()
    return base64.b64encode(pickle.dumps({n: t.detach().cpu() for n, t in tensors.items()})).decode()


class SGLangLoraMixin(AdapterLoading):
    """`load_lora_adapter`, `load_lora_adapter_from_tensors`, `unload_lora_adapter` over HTTP."""

    _call: Callable[..., Awaitable[Any]]
    _each_worker: Callable[..., Awaitable[list[Any]]]
    _flush: Callable[[str], Awaitable[None]]
    _worker_version: Callable[..., Awaitable[int]]
    pause_mode: str
    tp_size: int

    async def _load_adapter(self, lora_name: str, source: AdapterSource, weight_version: int | None) -> int:
        """On every worker: from a directory every worker can read (`/load_lora_adapter`), or from
        PEFT-named tensors, one serialized copy per TP rank (`/load_lora_adapter_from_tensors`)."""
        if isinstance(source, AdapterFiles):
            body: dict[str, Any] = {"lora_name": lora_name, "lora_path": source.path}
            return await self._adapter_refit(lora_name, "/load_lora_adapter", body, weight_version)
        blob = serialize_tensor_dict(source.tensors)
        body = {
            "lora_name": lora_name,
            "config_dict": jsonable_config(source.config),
            "serialized_named_tensors": [blob] * self.tp_size,
        }
        return await self._adapter_refit(lora_name, "/load_lora_adapter_from_tensors", body, weight_version)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Unload an adapter on every worker."""
        await self._each_worker(
            "unload_lora_adapter",
            lambda url: self._call("POST", "/unload_lora_adapter", {"lora_name": lora_name}, base=url),
        )

    async def _adapter_refit(
        self, lora_name: str, path: str, body: dict[str, Any], version: int | None
    ) -> int:
        async def one(url: str) -> int:
            await self._call("POST", "/pause_generation", {"mode": self.pause_mode}, base=url)
            try:
                await self._flush(url)
                try:
                    await self._call("POST", path, body, base=url)
                except InvalidRequest as exc:
                    if "already" not in str(exc):
                        raise
                    await self._call("POST", "/unload_lora_adapter", {"lora_name": lora_name}, base=url)
                    await self._call("POST", path, body, base=url)
                if version is not None:
                    update = {"new_version": str(version), "abort_all_requests": False}
                    await self._call("POST", "/update_weight_version", update, base=url)
                return await self._worker_version(url, version, path)
            finally:
                await self._call("POST", "/continue_generation", {}, base=url)

        versions = await self._each_worker(path.strip("/"), one)
        return int(versions[0])
