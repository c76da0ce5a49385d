"""`FullyAsyncRollout`: generate continuously while the trainer trains (bounded staleness).

A producer task keeps groups in flight between calls (`generate_and_rm_group`, the same
retry → FAILED and dynamic-filter rules as `InferenceRollout`). Finished groups enter a bounded
buffer: groups buffered plus groups in flight never exceed `async_buffer_groups`, so the
producer waits when the buffer is full (backpressure).

Each training call takes `batch_size` groups, oldest first, whose OLDEST weight version — the
smallest engine weight version any of their samples was generated with (a resumed partial
sample records several) — lags `request.weight_version` by at most `max_weight_staleness`.
Too-stale groups, and groups that came back aborted (e.g. an engine that aborts requests to
update its weights), are handled per `stale_policy`:

- `retry`: handed back to the data source — reset to fresh prompts, or with `partial_rollout`
  kept with their partial tokens and resumed (masked per `mask_offpolicy_in_partial_rollout`);
- `drop`: discarded and counted.

Nothing is silently lost: every prompt taken from the data source is trained on, buffered,
in flight, handed back, or dropped and counted (`rollout/stale_dropped`,
`rollout/aborted_dropped`, `rollout/dropped/<filter>`, `rollout/failed_groups`).
`state_dict()` holds the buffered groups and the groups in flight (as fresh prompts), so a
resume loses none. `close()` stops the producer, aborts its engine requests and hands every
unfinished and buffered group back to the data source.

**`max_weight_staleness = 0` is synchronous training.** Every group must then come from the
weights of the very call that takes it, so nothing may be generated ahead: each call runs one
rollout exactly as `InferenceRollout` does (same waves, sample indices, per-sample seeds,
filters, hand-backs) and no producer starts. With the same seeds and config a staleness-0 run
gives the same batches and weights as `fully_async = false` (`test_fully_async_staleness0.py`).

The options (`max_weight_staleness`, `async_buffer_groups`, `stale_policy`) are the strategy's
own (`FullyAsyncRollout.Options`, from `rollout.strategy_options`; see `fully_async_options`).

The producer runs on the event loop of whoever calls the strategy: it overlaps with training
only if that loop keeps running between calls (the trainer's `RolloutSide` runs its loop in a
background thread), or when the engine is another process (`verst serve`, SGLang).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections import deque
from typing import Any, ClassVar

from verst.rollout.engine import SamplingParams
from verst.rollout.errors import RolloutError
from verst.rollout.generate import reset_sample
from verst.rollout.logging_utils import log_first_sample, log_rollout_finish
from verst.rollout.protocols import (
    Capability,
    GenerateState,
    RolloutContext,
    RolloutRequest,
    RolloutResult,
    strategy_options,
)
from verst.rollout.sample import Sample
from verst.rollout.sampling import sampling_params_for
from verst.rollout.strategies.fully_async_options import FullyAsyncOptions
from verst.rollout.strategies.fully_async_producer import AsyncTally, Buffered, ProducerError, ProducerMixin
from verst.rollout.strategies.inference import (
    InferenceRollout,
    RolloutStalledError,
)

logger = logging.getLogger(__name__)

STATE_VERSION = 1
"""Version of `FullyAsyncRollout.state_dict()`'s layout."""

__all__ = ["STATE_VERSION", "FullyAsyncRollout", "ProducerError"]


class FullyAsyncRollout(ProducerMixin, InferenceRollout):
    """Fully-async rollout with a bounded buffer and bounded staleness (see the module docstring).

    Eval requests run like `InferenceRollout`'s (they do not touch the buffer) while the
    producer keeps generating.
    """

    capabilities: ClassVar[frozenset[Capability]] = frozenset(Capability)
    Options: ClassVar[type[FullyAsyncOptions]] = FullyAsyncOptions
    """`rollout.strategy_options`: max_weight_staleness, async_buffer_groups, stale_policy
    (a subclass extends it with its own)."""

    def __init__(self, context: RolloutContext) -> None:
        super().__init__(context)
        config = context.config
        self.options: FullyAsyncOptions = strategy_options(type(self), config)
        """The validated `rollout.strategy_options`."""
        if self.options.async_buffer_groups < config.batch_size:
            raise ValueError(
                f"rollout.strategy_options.async_buffer_groups = {self.options.async_buffer_groups} cannot "
                f"hold one batch of rollout.batch_size = {config.batch_size} groups; set "
                f"async_buffer_groups >= {config.batch_size}"
            )
        self.buffer: deque[Buffered] = deque()
        """Finished groups waiting for a training call, oldest first."""
        self.last_dropped_groups: list[list[Sample]] = []
        """Groups dropped (too stale or aborted, `stale_policy = "drop"`) since the previous call."""
        self.peak_buffer = 0
        """The most groups ever buffered at once (at most `async_buffer_groups`)."""
        self.produced_groups = 0
        """Groups that finished and entered the buffer, in total."""
        self._cond = asyncio.Condition()
        self._in_flight: dict[asyncio.Task[None], list[Sample]] = {}
        self._resume: list[list[Sample]] = []
        self._closing_unfinished: list[list[Sample]] = []
        self._dropped: list[list[Sample]] = []
        self._failed: list[list[Sample]] = []
        self._tally = AsyncTally()
        self._producer: asyncio.Task[None] | None = None
        self._producer_error: BaseException | None = None
        self._state: GenerateState | None = None
        self._params: SamplingParams = sampling_params_for(config)
        self._version = 0
        self._exhausted = False
        self._closing = False
        self._closed = False
        self._next_group = 0
        self._next_sample = 0
        self._pulled_since_kept = 0
        self._stalled = False
        self._last_call = time.perf_counter()

    # ------------------------------------------------------------------ protocol

    async def __call__(self, request: RolloutRequest) -> RolloutResult:
        if self._closed or self._closing:
            raise RuntimeError("FullyAsyncRollout is closed; build a new strategy to generate again")
        if request.evaluation:
            return await self._evaluate(request)
        if self.options.max_weight_staleness == 0:
            return await self._rollout(request)  # synchronous: nothing generated ahead (see above)
        return await self._take(request)

    def state_dict(self) -> dict[str, Any]:
        """Counters, buffered groups, and the groups in flight as fresh prompts (resumed first)."""
        pending = [*self._resume, *self._closing_unfinished]
        pending += [[reset_sample(s.clone()) for s in g] for g in self._in_flight.values()]
        return {
            "version": STATE_VERSION,
            "counters": dict(self._counters),
            "weight_version": self._version,
            "buffer": [
                {"group": [s.to_dict() for s in b.group], "fallback_version": b.fallback_version}
                for b in self.buffer
            ],
            "pending": [[s.to_dict() for s in g] for g in pending],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"FullyAsyncRollout state has version {state.get('version')!r}, expected {STATE_VERSION}; "
                f"it was saved by an incompatible verst version (or by another strategy)"
            )
        if self._producer is not None:
            raise RuntimeError("load_state_dict must be called before the first rollout (the producer runs)")
        self._counters.update(state["counters"])
        # a run that switched from the default strategy has counters only (nothing buffered)
        self._version = int(state.get("weight_version", 0))
        self.buffer = deque(
            Buffered([Sample.from_dict(d) for d in b["group"]], int(b["fallback_version"]))
            for b in state.get("buffer", [])
        )
        self._resume = [[Sample.from_dict(d) for d in g] for g in state.get("pending", [])]

    async def close(self) -> None:
        """Stop the producer, abort its requests, hand in-flight and buffered groups back."""
        if self._closed:
            return
        self._closing = True
        try:
            async with self._cond:
                self._cond.notify_all()
            if self._producer is not None:
                await asyncio.wait({self._producer}, timeout=self.abort_grace_s)
                if not self._producer.done():
                    self._producer.cancel()
            unfinished = await self._stop_in_flight()
            groups = [*self._resume, *self._closing_unfinished, *unfinished, *(b.group for b in self.buffer)]
            self._resume, self._closing_unfinished = [], []
            self.buffer.clear()
            tally = AsyncTally()
            self._hand_back(groups, tally)
            if groups:
                logger.info("fully-async close: handed %d groups back to the data source", len(groups))
        finally:
            self._closed = True
            await super().close()

    # ------------------------------------------------------------------ the producer

    def _room(self) -> int:
        return self.options.async_buffer_groups - len(self.buffer) - len(self._in_flight)

    def _start(self, request: RolloutRequest) -> None:
        """Start the producer on the first call; later calls update the state it generates with."""
        self._version = request.weight_version
        if self._state is None:
            self._state = self.new_state(request, "a", per_rollout=False)
        else:
            self._state.rollout_id = request.rollout_id
            self._state.weight_version = request.weight_version
        if self._producer is None:
            self._producer = asyncio.create_task(self._produce(), name="verst-fully-async-producer")

    # ------------------------------------------------------------------ the consumer

    def _evict_stale(self, version: int) -> None:
        """Retry or drop buffered groups older than `max_weight_staleness` versions."""
        options = self.options
        keep: deque[Buffered] = deque()
        for b in self.buffer:
            if version - b.oldest_version() <= options.max_weight_staleness:
                keep.append(b)
            elif options.stale_policy == "retry":
                self._tally.stale_retried += 1
                self._give_back([b.group], fresh=True)
            else:
                self._tally.stale_dropped += 1
                self._dropped.append(b.group)
        self.buffer = keep

    async def _take(self, request: RolloutRequest) -> RolloutResult:
        started = time.perf_counter()
        target = self.context.config.batch_size
        self._stalled, self._pulled_since_kept = False, 0  # each call may pull its own waves
        self._start(request)
        taken: list[Buffered] = []
        try:
            async with self._cond:
                while True:
                    self._evict_stale(request.weight_version)
                    while self.buffer and len(taken) < target:
                        taken.append(self.buffer.popleft())
                    self._cond.notify_all()  # room for the producer; hand-backs to pick up
                    if len(taken) >= target:
                        break
                    if isinstance(self._producer_error, RolloutError):
                        raise self._producer_error
                    if self._producer_error is not None:
                        raise ProducerError(
                            f"the fully-async producer stopped: {type(self._producer_error).__name__}: "
                            f"{self._producer_error}"
                        ) from self._producer_error
                    if self._stalled and not self._in_flight:
                        if not taken:
                            raise self._stalled_error(request)
                        break
                    if self._exhausted and not self._in_flight and not self._resume:
                        logger.warning(
                            "rollout %d: the data source ran out; returning %d of %d groups",
                            request.rollout_id,
                            len(taken),
                            target,
                        )
                        break
                    await self._cond.wait()
        except BaseException:  # cancelled, or the producer failed: the groups taken stay buffered
            self.buffer.extendleft(reversed(taken))
            raise
        return self._result(request, taken, started)

    def _stalled_error(self, request: RolloutRequest) -> RolloutStalledError:
        tally = self._tally
        tally.waves = -(-self._pulled_since_kept // self.context.config.effective_over_sampling_batch_size)
        return self._stall_error(request.rollout_id, 0, tally)

    def _result(self, request: RolloutRequest, taken: list[Buffered], started: float) -> RolloutResult:
        kept = [b.group for b in taken]
        tally, self._tally = self._tally, AsyncTally(failure_streak=self._tally.failure_streak)
        tally.wave_limit_hit = self._stalled and len(kept) < self.context.config.batch_size
        failed, self._failed = self._failed, []
        self.last_dropped_groups, self._dropped = self._dropped, []
        self.last_failed_groups = failed
        metrics = self._metrics(kept, failed, tally, started)
        now = time.perf_counter()
        since = now - self._last_call
        self._last_call = now
        staleness = [request.weight_version - b.oldest_version() for b in taken]
        metrics.update(
            {
                "rollout/wait_s": now - started,
                "rollout/tokens_per_s": tally.generated_tokens / since if since > 0 else 0.0,
                "rollout/buffer_size": float(len(self.buffer)),
                "rollout/in_flight_groups": float(len(self._in_flight)),
                "rollout/staleness_mean": statistics.fmean(staleness) if staleness else 0.0,
                "rollout/staleness_max": float(max(staleness, default=0)),
                "rollout/stale_retried": float(tally.stale_retried),
                "rollout/stale_dropped": float(tally.stale_dropped),
                "rollout/aborted_retried": float(tally.aborted_retried),
                "rollout/aborted_dropped": float(tally.aborted_dropped),
            }
        )
        self._counters["rollouts"] += 1
        self._counters["kept_groups"] += len(kept)
        self._counters["failed_groups"] += len(failed)
        if kept:
            log_first_sample(logger, kept[0][0], label=f"rollout {request.rollout_id}")
        log_rollout_finish(logger, request.rollout_id, metrics)
        return RolloutResult(groups=kept, metrics=metrics)
