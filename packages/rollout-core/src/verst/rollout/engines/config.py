"""The `[engine]` config section and `build_engine`, which turns it into an `InferenceEngine`.

type = "embedded"        the model in this process (CPU or GPU), extra `local`
type = "sglang"          existing SGLang servers (`urls`) or a router (`router_url`)
type = "sglang_launch"   start SGLang servers (and a router) for the run, extra `sglang`
"""

from __future__ import annotations

import asyncio
import math
from typing import Literal

from pydantic import Field

from verst.rollout.config import Section
from verst.rollout.engine import InferenceEngine
from verst.rollout.errors import ConfigError, Problem


class EngineConfig(Section):
    """Which inference engine rollouts use, and how it is started."""

    type: Literal["embedded", "sglang", "sglang_launch"] = Field(
        "embedded",
        description="embedded (in-process HF model), sglang (existing servers), sglang_launch (start them).",
    )
    model_path: str | None = Field(
        None, description="Model directory (HF layout); None = the trainer's model."
    )
    tokenizer_path: str | None = Field(None, description="Tokenizer directory (None = model_path).")
    device: Literal["cpu", "cuda", "auto"] = Field(
        "auto", description="Embedded engine device (auto = cuda if available)."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="Embedded engine weight dtype (log-probs are always computed in float32)."
    )
    max_batch_size: int = Field(
        64, ge=1, description="Embedded engine: rows decoded together; more requests queue."
    )
    num_engines: int = Field(1, ge=1, description="Number of engines (embedded copies or launched servers).")
    num_threads: int | None = Field(
        None, ge=1, description="torch CPU threads for the embedded engine (None = torch's)."
    )
    urls: list[str] = Field(default_factory=list, description="type=sglang: base URLs of running servers.")
    router_url: str | None = Field(
        None, description="type=sglang: a router in front of the servers (aborts go to each worker)."
    )
    host: str = Field("127.0.0.1", description="type=sglang_launch: bind address of launched servers.")
    port_base: int | None = Field(
        None, ge=1, le=65535, description="type=sglang_launch: first port (None = free ports)."
    )
    tp_size: int = Field(1, ge=1, description="type=sglang_launch: tensor-parallel size per server.")
    mem_fraction_static: float | None = Field(
        None,
        gt=0,
        le=1,
        description="type=sglang_launch: SGLang --mem-fraction-static (None = SGLang's default).",
    )
    launch_router: bool = Field(
        True, description="type=sglang_launch: put a router in front of several servers."
    )
    router_policy: str = Field("cache_aware", description="type=sglang_launch: router --policy.")
    extra_args: list[str] = Field(
        default_factory=list, description="type=sglang_launch: extra launch_server arguments."
    )
    ready_timeout_s: float = Field(
        900.0, gt=0, description="type=sglang_launch: seconds to wait for /health_generate."
    )
    request_timeout_s: float = Field(600.0, gt=0, description="HTTP engines: timeout of one request.")
    max_retries: int = Field(
        3, ge=0, description="HTTP engines: retries of a retryable failure (connection error, 5xx)."
    )
    backoff_s: float = Field(0.5, ge=0, description="HTTP engines: first retry delay, doubled each retry.")
    pause_mode: Literal["abort", "retract", "in_place"] = Field(
        "retract", description="HTTP engines: /pause_generation mode used during a weight refit."
    )


def engine_problems(c: EngineConfig, *, fallback_model_path: str | None = None) -> list[Problem]:
    """The `[engine]` section's problems (checked before anything loads); `fallback_model_path`
    is the model the engine gets when `engine.model_path` is unset (the trainer's)."""
    out = []
    if c.type in ("embedded", "sglang_launch") and not (c.model_path or fallback_model_path):
        out.append(Problem("engine.model_path", f"type={c.type!r} needs a model", "set engine.model_path"))
    if c.type == "sglang" and not (c.urls or c.router_url):
        out.append(
            Problem("engine.urls", "type='sglang' needs servers", "set engine.urls or engine.router_url")
        )
    return out


async def build_engine(config: EngineConfig, *, max_concurrency: int) -> InferenceEngine:
    """Create the engine the config describes (an `EnginePool` when there are several)."""
    from verst.rollout.engines.pool import EnginePool

    problems = engine_problems(config)
    if problems:
        raise ConfigError(problems)
    if config.type == "embedded":
        from verst.rollout.engines.embedded import EmbeddedEngine

        def make() -> EmbeddedEngine:
            assert config.model_path is not None
            return EmbeddedEngine.from_pretrained(
                config.model_path,
                device=config.device,
                dtype=config.dtype,
                tokenizer=config.tokenizer_path,
                num_threads=config.num_threads,
                max_batch_size=config.max_batch_size,
            )

        engines = [await asyncio.to_thread(make) for _ in range(config.num_engines)]
        return engines[0] if len(engines) == 1 else EnginePool(engines)

    from verst.rollout.engines.sglang_client import SGLangClient

    def client(url: str, router: bool, share: int) -> SGLangClient:
        return SGLangClient(
            url,
            max_connections=max(1, share),
            timeout_s=config.request_timeout_s,
            max_retries=config.max_retries,
            backoff_s=config.backoff_s,
            router=router,
            pause_mode=config.pause_mode,
            tp_size=config.tp_size,
        )

    if config.type == "sglang":
        if config.router_url:
            return client(config.router_url, True, max_concurrency)
        share = math.ceil(max_concurrency / len(config.urls))
        clients = [client(u, False, share) for u in config.urls]
        return clients[0] if len(clients) == 1 else EnginePool(clients)

    from verst.rollout.engines.launcher import launch_sglang_servers

    assert config.model_path is not None
    with_router = config.launch_router and config.num_engines > 1
    launched = await asyncio.to_thread(
        launch_sglang_servers,
        config.model_path,
        num_servers=config.num_engines,
        host=config.host,
        port_base=config.port_base,
        tp_size=config.tp_size,
        mem_fraction_static=config.mem_fraction_static,
        extra_args=config.extra_args,
        router=with_router,
        router_policy=config.router_policy,
        ready_timeout_s=config.ready_timeout_s,
    )
    if launched.router_url:
        engines: list[InferenceEngine] = [client(launched.router_url, True, max_concurrency)]
    else:
        share = math.ceil(max_concurrency / len(launched.urls))
        engines = [client(u, False, share) for u in launched.urls]
    return EnginePool(engines, on_close=[launched.close])
