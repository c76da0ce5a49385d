"""`LegacyRuntime`: what a v1 rollout function reaches the engine, tokenizer and sink through.

slime's `generate_rollout` finds its engine, tokenizer and reward functions in module-global
state (the `GenerateState` singleton, built lazily from `args`). verst has no global singletons:
the `LegacyRolloutStrategy` builds one `LegacyRuntime` per strategy from its `RolloutContext`
and hands it to `generate_rollout` explicitly, or through the v1 args namespace it built
(`args.runtime`), so a v1 caller writing `generate_rollout(args, rollout_id, data_source)` with
those args still works.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from verst.rollout.protocols import ContextViews, GenerateFn, GenerateState, RolloutContext

T = TypeVar("T")


@dataclass
class LegacyRuntime(ContextViews):
    """The per-strategy objects a v1 rollout function needs, passed explicitly (never global).

    The surface is the strategy's `RolloutContext` plus two things a v1 function cannot learn
    from its `(args, rollout_id, data_source, evaluation)` signature: the weight version the
    current rollout was requested at, and the event loop that owns the engine.
    """

    context: RolloutContext
    """Engine, tokenizer, reward functions, lifecycle sink, eval datasets, config, environment."""
    weight_version: int = 0
    """The weight version of the rollout being generated (the strategy sets it per request)."""
    loop: asyncio.AbstractEventLoop | None = None
    """The event loop that owns the engine (the strategy's). When it runs in another thread,
    `generate_rollout` submits its coroutine there (engines with loop-bound HTTP sessions or
    batching tasks keep working); when None, `generate_rollout` runs its own `asyncio.run`."""
    current_state: GenerateState | None = None
    """The `GenerateState` of the rollout in progress (None between rollouts); `close` sets its
    abort flag to stop a rollout early."""
    generate_fn_cache: dict[str, GenerateFn] = field(default_factory=dict)
    """Generate functions loaded so far, by import path (the custom one and per-sample ones)."""

    @property
    def generate_context(self) -> RolloutContext:
        """The context the rollout's `GenerateState` carries: the strategy's, with the runtime
        added to the v1 args (`args.runtime`) that v1 generate functions receive — on the
        legacy path they reach the engine and tokenizer there, where slime kept them in its
        module-global `GenerateState`."""
        return replace(self.context, v1_args={**self.context.v1_args, "runtime": self})

    def generate_fn(self, args: Any) -> GenerateFn | None:
        """The generate function `args.custom_generate_function_path` names (loaded once), or None
        for rollout-core's `SingleTurnGenerate`. A v1 `(args, sample, sampling_params)` function
        is wrapped in `LegacyGenerateFnAdapter` by rollout-core's loader."""
        path = getattr(args, "custom_generate_function_path", None)
        if not path:
            return None
        fn = self.generate_fn_cache.get(path)
        if fn is None:
            from verst.rollout.loading import load_generate_function

            fn = load_generate_function(path, self.config, v1_args=self.generate_context.v1_args)
            self.generate_fn_cache[path] = fn
        return fn

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` to completion from synchronous code and return its result.

        On the runtime's home loop when it has one running in another thread, otherwise in a
        fresh `asyncio.run` in the calling thread. Calling this from inside a running event
        loop's own thread would block that loop, so it is refused with the fix.
        """
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None:
            coro.close()
            raise RuntimeError(
                "generate_rollout is a synchronous v1 function but was called from inside a running "
                "event loop (it would block that loop); call it from a worker thread, e.g. "
                "`await asyncio.to_thread(generate_rollout, args, rollout_id, data_source)`"
            )
        home = self.loop
        if home is not None and home.is_running() and not home.is_closed():
            if getattr(home, "_thread_id", None) == threading.get_ident():  # pragma: no cover
                coro.close()
                raise RuntimeError("generate_rollout cannot block the thread of its own event loop")
            return asyncio.run_coroutine_threadsafe(coro, home).result()
        return asyncio.run(coro)


def runtime_of(args: Any, runtime: LegacyRuntime | None) -> LegacyRuntime:
    """The runtime to use: the explicit one, else `args.runtime`; a clear error when neither."""
    if runtime is not None:
        return runtime
    found = getattr(args, "runtime", None)
    if isinstance(found, LegacyRuntime):
        return found
    raise TypeError(
        "generate_rollout needs a LegacyRuntime (engine, tokenizer, rewards, sink): pass "
        "`runtime=...`, or use the args built by LegacyRolloutStrategy (which carry `args.runtime`); "
        f"got args of type {type(args).__name__} without one"
    )
