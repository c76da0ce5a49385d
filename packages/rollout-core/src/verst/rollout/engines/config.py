"""The `[engine]` config section: one config model per engine, chosen by `type`.

type = "embedded"            the model in this process (CPU or GPU), extra `local`
type = "sglang"              existing SGLang servers (`urls`) or a router (`router_url`)
type = "sglang_launch"       start SGLang servers (and a router) for the run, extra `sglang`
type = "vllm"                existing vLLM servers (`urls`; verst.rollout.engines.vllm)
type = "vllm_launch"         start vLLM servers from their own interpreter (`engine.python`)
type = "pkg.module:Engine"   your own engine: a class whose nested `Config` subclasses `EngineSection`

Each config owns its fields and knows three things: `capabilities()` (what the engine can do —
validation asks this instead of comparing type names), `problems(key)` (its own config checks)
and `build(max_concurrency=...)` (the engine). `ENGINES` is the one table of built-in engines;
adding one is a config class (subclassing `section.EngineSection`; in its own folder, like
`vllm/config.py`) plus one entry (see docs/engines.md, "Adding an engine").
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Literal

from pydantic import Field

from verst.rollout.config import path_field
from verst.rollout.engine import EngineCapabilities, InferenceEngine
from verst.rollout.engines.embedded.speculative.config import SpeculativeConfig, SpeculativeOff
from verst.rollout.engines.section import EngineSection, HttpEngineSection
from verst.rollout.engines.vllm.config import VllmEngineConfig, VllmLaunchEngineConfig
from verst.rollout.errors import ConfigError, Problem
from verst.rollout.variants import VariantTable


class EmbeddedEngineConfig(EngineSection):
    """The embedded engine: a Hugging Face causal LM in this process (extra `local`)."""

    type: Literal["embedded"] = Field("embedded", description="The in-process engine.")
    tokenizer_path: str | None = path_field(description="Tokenizer directory (None = model_path).")
    device: Literal["cpu", "cuda", "auto"] = Field("auto", description="Device (auto = cuda if available).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="Weight dtype (log-probs are always computed in float32)."
    )
    max_batch_size: int = Field(64, ge=1, description="Rows decoded together; more requests queue.")
    num_engines: int = Field(1, ge=1, description="Copies of the model (an EnginePool when more than one).")
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads (None = torch's).")
    prefix_sharing: bool = Field(
        True,
        description=(
            "Prefill identical prompts of one admission (a GRPO group's samples) once and copy "
            "their KV cache per row."
        ),
    )
    speculative: SpeculativeConfig = Field(
        default_factory=SpeculativeOff,
        description=(
            "Speculative decoding: a proposer table (type ngram or draft_model, num_tokens, ...; "
            "default off); the output distribution and log-probs stay the target's (docs/engines.md)."
        ),
    )

    def problems(self, key: str = "engine") -> list[Problem]:
        return self.speculative.problems(f"{key}.speculative")

    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            in_process=True,
            uses_gpu=self.device != "cpu",
            needs_model_path=True,
            weight_sync=("tensors", "disk"),
            release_memory=True,
            ray_engine_actors=True,
            engine_count=self.num_engines,
            lora=True,
            routing_replay=True,
            weight_dtype=None if self.dtype == "auto" else self.dtype,
            partial_weights=True,
        )

    async def build(self, *, max_concurrency: int) -> InferenceEngine:
        from verst.rollout.engines.embedded.engine import EmbeddedEngine
        from verst.rollout.engines.pool import EnginePool

        def make() -> EmbeddedEngine:
            assert self.model_path is not None
            return EmbeddedEngine.from_pretrained(
                self.model_path,
                device=self.device,
                dtype=self.dtype,
                tokenizer=self.tokenizer_path,
                num_threads=self.num_threads,
                max_batch_size=self.max_batch_size,
                prefix_sharing=self.prefix_sharing,
                speculative=self.speculative,
            )

        engines = [await asyncio.to_thread(make) for _ in range(self.num_engines)]
        return engines[0] if len(engines) == 1 else EnginePool(engines)


class HttpEngineConfig(HttpEngineSection):
    """Shared fields of engines reached over SGLang's HTTP API (`SGLangClient`)."""

    tp_size: int = Field(1, ge=1, description="Tensor-parallel size per server.")
    pause_mode: Literal["abort", "retract", "in_place"] = Field(
        "retract", description="/pause_generation mode used during a weight refit."
    )
    routed_experts: bool = Field(
        False,
        description=(
            "The servers return the MoE experts they chose (SGLang --enable-return-routed-experts; "
            "verst serve always can): declares the routing_replay capability that "
            "train.moe.routing_replay = 'rollout' needs. sglang_launch adds the flag itself."
        ),
    )

    def _client(self, url: str, router: bool, share: int) -> InferenceEngine:
        from verst.rollout.engines.sglang.client import SGLangClient

        return SGLangClient(
            url, router=router, pause_mode=self.pause_mode, tp_size=self.tp_size, **self.http_options(share)
        )

    def _clients(
        self, urls: list[str], router_url: str | None, max_concurrency: int
    ) -> list[InferenceEngine]:
        """One client for a router, else one per server sharing the concurrency."""
        if router_url:
            return [self._client(router_url, True, max_concurrency)]
        share = math.ceil(max_concurrency / len(urls))
        return [self._client(u, False, share) for u in urls]


class SGLangEngineConfig(HttpEngineConfig):
    """SGLang servers (or `verst serve`) that are already running, or a router in front of them."""

    type: Literal["sglang"] = Field("sglang", description="Existing SGLang servers or a router.")
    urls: list[str] = Field(default_factory=list, description="Base URLs of running servers.")
    router_url: str | None = Field(
        None, description="A router in front of the servers (aborts go to each worker)."
    )

    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            weight_sync=("disk", "distributed", "tensors"),
            release_memory=True,
            engine_count=None if self.router_url else len(self.urls),
            lora=True,  # servers launched with --enable-lora (docs/lora.md)
            routing_replay=self.routed_experts,
            partial_weights=True,  # SGLang's load_weights / verst serve take any subset
        )

    def problems(self, key: str = "engine") -> list[Problem]:
        if self.urls or self.router_url:
            return []
        return [Problem(f"{key}.urls", "type='sglang' needs servers", f"set {key}.urls or {key}.router_url")]

    async def build(self, *, max_concurrency: int) -> InferenceEngine:
        from verst.rollout.engines.pool import EnginePool

        clients = self._clients(self.urls, self.router_url, max_concurrency)
        return clients[0] if len(clients) == 1 else EnginePool(clients)


class SGLangLaunchEngineConfig(HttpEngineConfig):
    """SGLang servers (and a router) started for the run (extra `sglang`)."""

    type: Literal["sglang_launch"] = Field("sglang_launch", description="Start SGLang servers for the run.")
    num_engines: int = Field(1, ge=1, description="Servers to launch.")
    host: str = Field("127.0.0.1", description="Bind address of launched servers.")
    port_base: int | None = Field(None, ge=1, le=65535, description="First port (None = free ports).")
    mem_fraction_static: float | None = Field(
        None, gt=0, le=1, description="SGLang --mem-fraction-static (None = SGLang's default)."
    )
    launch_router: bool = Field(True, description="Put a router in front of several servers.")
    router_policy: str = Field("cache_aware", description="Router --policy.")
    base_gpu_id: int = Field(
        0, ge=0, description="First GPU of the servers: server i gets --base-gpu-id base + i * tp_size."
    )
    memory_saver: bool = Field(
        False,
        description=(
            "--enable-memory-saver --enable-weights-cpu-backup (needed for colocated layouts: "
            "without them releasing memory is a no-op and released weights do not come back)."
        ),
    )
    deterministic_inference: bool = Field(
        False, description="--enable-deterministic-inference (SGLang honours sampling_seed only with it)."
    )
    extra_args: list[str] = Field(default_factory=list, description="Extra launch_server arguments.")
    ready_timeout_s: float = Field(900.0, gt=0, description="Seconds to wait for /health_generate.")

    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            uses_gpu=True,
            needs_model_path=True,
            weight_sync=("disk", "distributed", "tensors"),
            release_memory=True,
            engine_count=self.num_engines,
            launched_gpus=self.num_engines * self.tp_size,
            lora=True,
            routing_replay=self.routed_experts,
            partial_weights=True,
        )

    def with_lora(self, *, max_rank: int, target_modules: list[str], adapters: int) -> EngineSection:
        """Launch the servers with SGLang's LoRA flags (unless `extra_args` already sets them)."""
        if "--enable-lora" in self.extra_args:
            return self
        flags = ["--enable-lora", "--max-lora-rank", str(max_rank), "--lora-target-modules", *target_modules]
        flags += ["--max-loras-per-batch", str(max(8, adapters + 1))]
        return self.model_copy(update={"extra_args": [*self.extra_args, *flags]})

    async def build(self, *, max_concurrency: int) -> InferenceEngine:
        from verst.rollout.engines.pool import EnginePool
        from verst.rollout.engines.sglang.launcher import launch_sglang_servers

        assert self.model_path is not None
        launched = await asyncio.to_thread(
            launch_sglang_servers,
            self.model_path,
            num_servers=self.num_engines,
            host=self.host,
            port_base=self.port_base,
            tp_size=self.tp_size,
            base_gpu_id=self.base_gpu_id,
            mem_fraction_static=self.mem_fraction_static,
            memory_saver=self.memory_saver,
            deterministic=self.deterministic_inference,
            extra_args=[
                *self.extra_args,
                *(["--enable-return-routed-experts"] if self.routed_experts else []),
            ],
            router=self.launch_router and self.num_engines > 1,
            router_policy=self.router_policy,
            ready_timeout_s=self.ready_timeout_s,
        )
        engines = self._clients(launched.urls, launched.router_url, max_concurrency)
        return EnginePool(engines, on_close=[launched.close])


ENGINES: VariantTable[EngineSection] = VariantTable(
    "engine",
    EngineSection,
    {
        "embedded": EmbeddedEngineConfig,
        "sglang": SGLangEngineConfig,
        "sglang_launch": SGLangLaunchEngineConfig,
        "vllm": VllmEngineConfig,
        "vllm_launch": VllmLaunchEngineConfig,
    },
    default="embedded",
)
"""The engine table: built-in `type` → config model (import paths are resolved by the table)."""

EngineConfig = ENGINES.field
"""The annotation of an `[engine]`-like field: the config model its `type` selects."""


def parse_engine_config(data: dict[str, Any] | None = None, **fields: Any) -> EngineSection:
    """An engine config from a table (`{"type": "sglang", "urls": [...]}`) or keyword fields;
    raises pydantic's `ValidationError` like a section would."""
    from pydantic import TypeAdapter

    return TypeAdapter(EngineConfig).validate_python({**(data or {}), **fields})


def engine_problems(
    c: EngineSection, *, key: str = "engine", fallback_model_path: str | None = None
) -> list[Problem]:
    """The `[engine]` section's problems (checked before anything loads); `fallback_model_path`
    is the model the engine gets when `engine.model_path` is unset (the trainer's)."""
    out = []
    if c.capabilities().needs_model_path and not (c.model_path or fallback_model_path):
        out.append(Problem(f"{key}.model_path", f"type={c.type!r} needs a model", f"set {key}.model_path"))
    return out + c.problems(key)


async def build_engine(config: EngineSection, *, max_concurrency: int) -> InferenceEngine:
    """Create the engine the config describes (an `EnginePool` when there are several)."""
    problems = engine_problems(config)
    if problems:
        raise ConfigError(problems)
    return await config.build(max_concurrency=max_concurrency)
