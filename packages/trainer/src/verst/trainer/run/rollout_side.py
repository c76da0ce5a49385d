"""`RolloutSide`: the engine, the data source and the strategy, behind a narrow synchronous API.

The controller calls `rollout`, `evaluate`, `update_weights_from_tensors` /
`update_weights_from_disk`, `state_dict` / `load_state_dict` and `close` — nothing else — so a
Ray actor can implement the same surface. It owns its own asyncio event loop: strategies and
engines are async, the training loop is not. The loop runs in a background thread for the
side's whole life (calls are submitted with `run_coroutine_threadsafe`), so background work —
the fully-async producer — keeps generating while the trainer trains.

Before the first rollout the engine must answer its health check (`EngineUnavailableError`
otherwise, naming it). `rollout` and `evaluate` take an optional `stop` callable, polled while
the call runs: when it turns true the rollout is cancelled — its strategy aborts the engine
requests in flight and hands every group back to the data source — and `RolloutInterrupted`
is raised within seconds, so SIGTERM/SIGINT never wait for a rollout that cannot end.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from verst.rollout.data_sources import build_data_source, build_eval_sets
from verst.rollout.engine import (
    EngineCapabilities,
    EngineError,
    EngineTimeout,
    InferenceEngine,
    engine_capabilities,
)
from verst.rollout.engines.common.replicas import reported_weight_dtype
from verst.rollout.errors import ConfigError, EngineUnavailableError, Problem
from verst.rollout.lifecycle import LifecycleSink, NoopSink
from verst.rollout.loading import load_rollout_strategy
from verst.rollout.openmp import release_openmp_workers
from verst.rollout.protocols import RolloutContext, RolloutRequest, RolloutResult
from verst.rollout.rewards import build_reward_fns
from verst.rollout.selection import resolve_strategy_path
from verst.trainer.config import RunConfig
from verst.trainer.opd.scoring import TeacherScorer, build_teacher_engines

T = TypeVar("T")

HEALTH_WAIT_S = 20.0
"""How long the engine may take to answer its first health check (a server still starting, or
engine actors still loading their model on a busy machine); a request the engine refuses
outright (a malformed URL) fails at once."""
STOP_POLL_S = 0.1
"""How often a running rollout checks its `stop` callable."""


class RolloutInterrupted(Exception):
    """A rollout was cancelled because a stop was requested (its groups were handed back)."""


async def wait_healthy(engine: InferenceEngine, what: str, timeout_s: float = HEALTH_WAIT_S) -> None:
    """Return once `engine.health()` is true; raise `EngineUnavailableError` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last = "it answered unhealthy"
    while True:
        try:
            if await asyncio.wait_for(engine.health(), timeout_s):
                return
        except EngineTimeout:  # it accepted the probe and never answered: the error names the bound
            raise
        except Exception as exc:  # an unreachable or malformed URL, a timeout
            last = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, EngineError) and not exc.retryable:  # InvalidRequest: waiting cannot help
                deadline = time.monotonic()
        if time.monotonic() >= deadline:
            raise EngineUnavailableError(
                f"the engine {what} did not pass its health check within {timeout_s:.0f}s ({last}); "
                f"fix: start the server (`verst serve --model PATH --port N`, or SGLang) and check "
                f"engine.urls, or use engine.type = 'embedded'"
            )
        await asyncio.sleep(0.25)


async def build_engine_from_config(config: RunConfig, model_path: str) -> InferenceEngine:
    """The engine the `[engine]` section describes; its model defaults to the trainer's."""
    from verst.rollout.engines.config import build_engine

    engine_cfg = config.engine.with_model_path(model_path)
    if config.train.lora is not None:  # e.g. launched SGLang servers get --enable-lora and its limits
        lora = config.train.lora
        engine_cfg = engine_cfg.with_lora(
            max_rank=lora.rank, target_modules=lora.target_modules, adapters=1 + len(lora.serve)
        )
    return await build_engine(engine_cfg, max_concurrency=config.rollout.max_concurrency)


def _enable_exact(engine: InferenceEngine) -> None:
    """`train.exact_on_policy` on the engine (validation refused every engine that lacks it)."""
    enable = getattr(engine, "enable_exact_on_policy", None)
    if enable is None:
        raise ConfigError(
            [
                Problem(
                    "train.exact_on_policy",
                    f"cannot hold: {type(engine).__name__} cannot report the trainer's log-probs bit for bit",
                    "use engine.type = 'embedded' or set train.exact_on_policy = false",
                )
            ]
        )
    enable()


class RolloutSide:
    """Generates rollouts and evaluations; receives new weights."""

    def __init__(
        self,
        config: RunConfig,
        *,
        model_path: str,
        env: Mapping[str, str],
        sink: LifecycleSink | None = None,
        engine: InferenceEngine | None = None,
        tokenizer: Any = None,
        teacher_engines: Mapping[str, InferenceEngine] | None = None,
        fresh_engine: bool = False,
    ) -> None:
        """Build the data source, rewards, eval sets and the selected strategy.

        `engine` may be given (tests, or an engine shared with another component); otherwise it
        is built from `config.engine`. `teacher_engines` likewise replaces the engines of
        `[opd.teachers]` scored on the rollout side (by name). `fresh_engine`: the given engine
        was built for this run from `config.engine` (Ray engine actors), so it holds the model
        as loaded, like one built here.
        """
        self.engine_holds_model = (engine is None or fresh_engine) and loads_trainer_model(config, model_path)
        """The engine was built for this run and loaded the trainer's model itself (at version
        0 it holds exactly the trainer's starting weights; `WeightSync.align` then sends none).
        False for servers that were already running and for an engine handed in: another run
        may have refitted them."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="verst-rollout-loop", daemon=True)
        self._thread.start()
        self.engine: InferenceEngine | None = None
        try:
            self._build(config, model_path, env, sink, engine, tokenizer, teacher_engines)
        except BaseException:
            # A bad dataset or config must not leave the loop thread (or a built engine) running.
            if engine is None and self.engine is not None:
                self._run(self.engine.close())
            self._stop_loop()
            raise

    def _build(
        self,
        config: RunConfig,
        model_path: str,
        env: Mapping[str, str],
        sink: LifecycleSink | None,
        engine: InferenceEngine | None,
        tokenizer: Any,
        teacher_engines: Mapping[str, InferenceEngine] | None,
    ) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model_path)
        self._build_engine(config, model_path, engine)
        rc = config.rollout
        strategy_engine: InferenceEngine = self.engine
        if config.train.lora is not None:  # requests use the trained adapter unless a sample names one
            from verst.rollout.engines.common.lora import DefaultAdapterEngine

            strategy_engine = DefaultAdapterEngine(self.engine, config.train.lora.adapter_name)  # type: ignore[assignment]
        limit = rc.max_context_len or model_context_length(model_path)
        vision = vision_processor(model_path, self.tokenizer, config.run.output_dir)
        self.data_source = build_data_source(
            rc.data, rc.n_samples_per_prompt, tokenizer=self.tokenizer, max_prompt_tokens=limit, vision=vision
        )
        reward_fn, group_reward_fn = build_reward_fns(rc)
        self.strategy_path = resolve_strategy_path(rc, env)
        context = RolloutContext(
            config=rc,
            data_source=self.data_source,
            engine=strategy_engine,
            tokenizer=self.tokenizer,
            reward_fn=reward_fn,
            group_reward_fn=group_reward_fn,
            sink=sink or NoopSink(),
            eval_datasets=build_eval_sets(
                rc.eval, tokenizer=self.tokenizer, max_prompt_tokens=limit, vision=vision
            ),
            env=dict(env),
            vision=vision,
            v1_args=v1_args_for(config, model_path),
        )
        self.has_eval = bool(context.eval_datasets)
        self.strategy = load_rollout_strategy(self.strategy_path, context)
        self.teacher_scorer: TeacherScorer | None = None
        """On-policy distillation: scores every rollout's samples with their teachers."""
        if config.opd.enabled:
            engines = teacher_engines
            if engines is None:
                engines = self._run(build_teacher_engines(config.opd, max_concurrency=rc.max_concurrency))
            self.teacher_scorer = TeacherScorer(config.opd, engines, temperature=rc.temperature)
        self._owns_teachers = teacher_engines is None

    def _build_engine(self, config: RunConfig, model_path: str, engine: InferenceEngine | None) -> None:
        """`self.engine` (the given one, or built from the config), healthy, and its capabilities."""
        self.engine = (
            engine if engine is not None else self._run(build_engine_from_config(config, model_path))
        )
        self.engine_capabilities: EngineCapabilities = (
            engine_capabilities(engine) if engine is not None else config.engine.capabilities()
        )
        """What the engine can do: the config's declaration, or a given engine's own; the weight
        dtype as the engine reports it when it does (`common.replicas.reported_weight_dtype`)."""
        self._run(wait_healthy(self.engine, _describe_engine(config, self.engine)))
        if config.train.exact_on_policy:
            _enable_exact(self.engine)
        reported = self._run(reported_weight_dtype(self.engine))
        if reported is not None:
            self.engine_capabilities = dataclasses.replace(self.engine_capabilities, weight_dtype=reported)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the side's loop (in its background thread) and wait for the result."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(
                "RolloutSide methods are synchronous; do not call them from its own event loop"
            )
        release_openmp_workers()  # this thread waits: let the engine's kernels spin (`openmp`)
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _run_until_stopped(self, coro: Coroutine[Any, Any, T], stop: Callable[[], bool] | None) -> T:
        """`_run`, but cancel `coro` (and wait for its clean-up) once `stop()` turns true."""
        if stop is None:
            return self._run(coro)
        task_box: list[asyncio.Task[T]] = []
        release_openmp_workers()

        async def guarded() -> T:
            task = asyncio.ensure_future(coro)
            task_box.append(task)
            return await task

        future = asyncio.run_coroutine_threadsafe(guarded(), self._loop)
        while True:
            try:
                return future.result(timeout=STOP_POLL_S)
            except concurrent.futures.TimeoutError:
                if stop():
                    break
        for task in task_box:
            self._loop.call_soon_threadsafe(task.cancel)
        try:
            return future.result()  # the strategy hands its groups back before this returns
        except (asyncio.CancelledError, concurrent.futures.CancelledError):
            raise RolloutInterrupted(
                "the rollout was stopped; its groups went back to the data source"
            ) from None

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start `coro` on the side's loop without waiting (e.g. an engine call that must run
        while this thread broadcasts weights); `.result()` on the returned future waits."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def rollout(
        self, rollout_id: int, weight_version: int, *, stop: Callable[[], bool] | None = None
    ) -> RolloutResult:
        """One training rollout; `RolloutInterrupted` once `stop()` turns true (see the module doc)."""
        from verst.rollout.engines.embedded.speculative.metrics import (
            speculative_counters,
            speculative_metrics,
        )

        request = RolloutRequest(rollout_id=rollout_id, weight_version=weight_version)
        before = speculative_counters(self.engine)
        scorer = self.teacher_scorer

        async def rollout_and_score() -> RolloutResult:
            result = await self.strategy(request)
            if scorer is not None:
                result.metrics.update(await scorer.score(result.groups, rid_prefix=f"opd-{rollout_id}"))
            result.metrics.update(speculative_metrics(before, speculative_counters(self.engine)))
            return result

        return self._run_until_stopped(rollout_and_score(), stop)

    def evaluate(
        self, rollout_id: int, weight_version: int, *, stop: Callable[[], bool] | None = None
    ) -> RolloutResult:
        """One pass over the eval datasets (empty result when none are configured)."""
        if not self.has_eval:
            return RolloutResult()
        request = RolloutRequest(rollout_id=rollout_id, weight_version=weight_version, evaluation=True)
        return self._run_until_stopped(self.strategy(request), stop)

    def update_weights_from_tensors(self, named_tensors: dict[str, Any], weight_version: int) -> int:
        """Push in-memory weights to the engine; returns the engine's new weight version."""
        return self._run(
            self.engine.update_weights_from_tensors(named_tensors, weight_version=weight_version)
        )

    def update_weights_from_disk(self, path: str, weight_version: int) -> int:
        """Make the engine load a checkpoint directory; returns its new weight version."""
        return self._run(self.engine.update_weights_from_disk(path, weight_version=weight_version))

    def load_lora_adapter(self, name: str, path: str, weight_version: int | None) -> int:
        """Make the engine load (or replace) a PEFT adapter directory; returns its weight version."""
        return self._run(self.engine.load_lora_adapter(name, path, weight_version=weight_version))

    def load_lora_adapter_from_tensors(
        self, name: str, tensors: dict[str, Any], config: dict[str, Any], weight_version: int | None
    ) -> int:
        """Hand the engine an adapter's tensors (in-process); returns its weight version."""
        return self._run(
            self.engine.load_lora_adapter_from_tensors(name, tensors, config, weight_version=weight_version)
        )

    def weight_version(self) -> int:
        """The engine's current weight version."""
        return self._run(self.engine.get_weight_version())

    def replica_states(self) -> list[tuple[Any, ...]]:
        """Who each engine replica is and the version it holds (`common.replicas`)."""
        from verst.rollout.engines.common.replicas import replica_states

        return list(self._run(replica_states(self.engine)))

    def state_dict(self) -> dict[str, Any]:
        """Data source and strategy state (buffered samples included).

        Taken on the loop thread, so a background producer cannot change either half in between.
        """

        async def snapshot() -> dict[str, Any]:
            return {"data_source": self.data_source.state_dict(), "strategy": self.strategy.state_dict()}

        return self._run(snapshot())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `state_dict`."""

        async def restore() -> None:
            self.data_source.load_state_dict(state["data_source"])
            self.strategy.load_state_dict(state["strategy"])

        self._run(restore())

    def close(self, *, close_engine: bool = True) -> None:
        """Close the strategy (unfinished samples go back to the data source) and the engine."""
        if self._loop.is_closed():
            return
        try:
            self._run(self.strategy.close())
            if close_engine:
                self._run(self.engine.close())
            if self.teacher_scorer is not None and self._owns_teachers:
                self._run(self.teacher_scorer.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        """Stop the background loop and its thread."""
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()


def loads_trainer_model(config: RunConfig, model_path: str) -> bool:
    """`[engine]` builds an engine that loads the trainer's model itself (embedded, launched
    servers, a custom engine that declares `needs_model_path`), not one that connects to
    running servers."""
    engine = config.engine.with_model_path(model_path)
    return engine.capabilities().needs_model_path and engine.model_path == model_path


def _describe_engine(config: RunConfig, engine: InferenceEngine) -> str:
    """The engine as the user configured it (type and URLs), for error messages."""
    urls = getattr(config.engine, "urls", None)
    if urls:
        return f"{engine!r} (engine.type = {config.engine.type!r}, engine.urls = {list(urls)!r})"
    return repr(engine)


def vision_processor(model_path: str, tokenizer: Any, output_dir: str) -> Any:
    """The `MultimodalProcessor` of a vision-language model (None for a text-only one); images
    that arrive without a file (base64, rendered by an environment) go to `<output_dir>/images`."""
    from pathlib import Path

    from transformers import AutoConfig

    from verst.rollout.multimodal.families import is_vision_config

    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return None
    if not is_vision_config(config):
        return None
    from verst.rollout.multimodal.images import ImageStore
    from verst.rollout.multimodal.processor import MultimodalProcessor

    store = ImageStore(Path(output_dir) / "images")
    return MultimodalProcessor.from_pretrained(model_path, tokenizer, config, store=store)


def model_context_length(model_path: str) -> int | None:
    """`max_position_embeddings` of a local model's config.json (None when unknown)."""
    import json
    from pathlib import Path

    config = Path(model_path) / "config.json"
    try:
        data = json.loads(config.read_text())
        value = data.get("max_position_embeddings") or (data.get("text_config") or {}).get(
            "max_position_embeddings"
        )
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def v1_args_for(config: RunConfig, model_path: str) -> dict[str, Any]:
    """What v1 (slime/miles-style) functions read from `args` beyond the rollout config: the
    checkpoint their tokenizer loads from (`args.hf_checkpoint`) and, for HTTP engines, the
    server or router they post to (`args.sglang_router_ip` / `args.sglang_router_port`)."""
    from urllib.parse import urlsplit

    engine = config.engine  # each engine type has its own fields; a custom one may have none of these
    tokenizer_path = getattr(engine, "tokenizer_path", None) or getattr(engine, "model_path", None)
    out: dict[str, Any] = {"hf_checkpoint": tokenizer_path or model_path}
    url = getattr(engine, "router_url", None) or next(iter(getattr(engine, "urls", None) or ()), None)
    if url:
        parts = urlsplit(url)
        if parts.hostname and parts.port:
            out["sglang_router_ip"], out["sglang_router_port"] = parts.hostname, parts.port
    return out
