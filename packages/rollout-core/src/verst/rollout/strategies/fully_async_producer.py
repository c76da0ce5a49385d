"""The fully-async strategy's background producer and what it files: it pulls groups from the
data source in waves, generates each with retries (`generate_and_rm_group`), files finished
groups into the bounded buffer (`Buffered`) or hands aborted ones back, and stops its in-flight
work on a refit or close. `FullyAsyncRollout` (`fully_async`) is the consumer side.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from verst.rollout.engine import EngineTimeout, SamplingParams
from verst.rollout.errors import RolloutError, RolloutFailedError
from verst.rollout.generate import GroupGenerationError, generate_and_rm_group, reset_sample
from verst.rollout.protocols import (
    GenerateState,
)
from verst.rollout.sample import Sample
from verst.rollout.strategies.inference import (
    max_waves,
)
from verst.rollout.strategies.rollout_state import RolloutTally, mark_failed, retryable

logger = logging.getLogger("verst.rollout.strategies.fully_async")


@dataclass
class AsyncTally(RolloutTally):
    """Counters since the last training call (turned into metrics by the next one)."""

    stale_retried: int = 0
    """Too-stale groups handed back to the data source."""
    stale_dropped: int = 0
    """Too-stale groups discarded (`stale_policy = "drop"`)."""
    aborted_retried: int = 0
    """Groups that finished with aborted samples, handed back."""
    aborted_dropped: int = 0
    """Groups that finished with aborted samples, discarded."""


@dataclass
class Buffered:
    """A finished group waiting to be trained on."""

    group: list[Sample]
    """The group's samples (all finished, passed the filters)."""
    fallback_version: int
    """Weight version known when it finished; used for samples that recorded no version."""

    def oldest_version(self) -> int:
        """The smallest weight version any sample of the group was generated with."""
        return min((v for s in self.group for v in s.weight_versions), default=self.fallback_version)


class ProducerError(RolloutError):
    """The background producer stopped on an error; the training call cannot be served."""


class ProducerMixin:
    """The producer half of `FullyAsyncRollout` (its state is set up by the strategy)."""

    context: Any
    options: Any
    buffer: Any
    last_dropped_groups: list[list[Sample]]
    peak_buffer: int
    produced_groups: int
    _cond: asyncio.Condition
    _in_flight: dict[asyncio.Task[None], list[Sample]]
    _resume: list[list[Sample]]
    _closing_unfinished: list[list[Sample]]
    _dropped: list[list[Sample]]
    _failed: list[list[Sample]]
    _tally: AsyncTally
    _producer_error: BaseException | None
    _state: GenerateState | None
    _params: SamplingParams
    _version: int
    _exhausted: bool
    _closing: bool
    _next_group: int
    _next_sample: int
    _pulled_since_kept: int
    _stalled: bool

    async def _produce(self) -> None:
        config = self.context.config
        wave = config.effective_over_sampling_batch_size
        try:
            while True:
                async with self._cond:
                    await self._cond.wait_for(
                        lambda: (
                            self._closing
                            or self._producer_error is not None
                            or (
                                self._room() > 0
                                and not self._stalled
                                and (bool(self._resume) or not self._exhausted)
                            )
                        )
                    )
                    if self._closing or self._producer_error is not None:
                        return
                if self._pulled_since_kept >= max_waves(config) * wave:
                    self._stalled = True  # every group is being dropped: wait for the next call
                    logger.warning(
                        "fully-async producer: %d groups pulled without keeping one; pausing "
                        "(max_waves_per_rollout)",
                        self._pulled_since_kept,
                    )
                    await self._notify()
                    continue
                room = self._room()
                groups = [self._resume.pop(0) for _ in range(min(room, len(self._resume)))]
                if len(groups) < room:
                    got = self.context.data_source.get_samples(min(wave, room - len(groups)))
                    if not got and not groups:
                        self._exhausted = True
                        logger.warning("fully-async producer: the data source ran out of prompts")
                        async with self._cond:
                            self._cond.notify_all()
                        continue
                    groups += got
                    self._pulled_since_kept += len(got)
                for group in groups:
                    self._submit(group)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._producer_error = exc
            logger.exception("fully-async producer failed")
            async with self._cond:
                self._cond.notify_all()
            raise

    def _submit(self, group: list[Sample]) -> None:
        for s in group:
            s.group_index, s.sample_index = self._next_group, self._next_sample
            self._next_sample += 1
        self._next_group += 1
        task = asyncio.create_task(self._run_group(group))
        self._in_flight[task] = group
        task.add_done_callback(lambda t: self._in_flight.pop(t, None))

    async def _run_group(self, group: list[Sample]) -> None:
        """Generate one group (retrying failures), then buffer, drop or hand it back."""
        try:
            samples = await self._generate_with_retries(group)
            if samples is not None:
                self._file(samples)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # e.g. a raising dynamic filter: surface it, lose no prompt
            self._producer_error = exc
            logger.exception("fully-async: handling a finished group failed")
            self._give_back([group], fresh=True)
        finally:
            # leave the in-flight set before waking the producer (its room counts it)
            self._in_flight.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
        await self._notify()

    async def _generate_with_retries(self, group: list[Sample]) -> list[Sample] | None:
        """The generated group, or None when it failed for good (marked FAILED) or is closing."""
        assert self._state is not None
        retries = 0
        while True:
            try:
                return await generate_and_rm_group(self._state, group, self._params)
            except GroupGenerationError as err:
                if self._closing:
                    self._closing_unfinished.append(group)
                    return None
                retry = retries < self.context.config.max_group_retries and retryable(err)
                self.log_group_failure(err, retry)
                if not retry:
                    self._failed.append(mark_failed(group, err))
                    self._tally.failed_groups += 1
                    self._tally.failure_streak.append(group)
                    self._check_streak(err.cause if isinstance(err.cause, EngineTimeout) else None)
                    return None
                retries += 1
                self._tally.group_retries += 1
                group = [reset_sample(s, keep_attempt=True) for s in group]

    def _file(self, samples: list[Sample]) -> None:
        """A generated group: into the buffer, dropped by a filter, or unfinished (retry/drop)."""
        kept: list[list[Sample]] = []
        unfinished: list[list[Sample]] = []
        self._classify(samples, kept, unfinished, self._tally)
        self._check_streak()
        if kept:
            self._pulled_since_kept = 0
        for g in kept:
            self.buffer.append(Buffered(g, self._version))
            self.produced_groups += 1
        self.peak_buffer = max(self.peak_buffer, len(self.buffer))
        for g in unfinished:
            if self._closing:
                self._closing_unfinished.append(g)
            elif self.options.stale_policy == "retry":
                self._tally.aborted_retried += 1
                self._give_back([g], fresh=False)
            else:
                self._tally.aborted_dropped += 1
                self._dropped.append(g)

    def _check_streak(self, stalled: EngineTimeout | None = None) -> None:
        """Past one batch of failed groups in a row, or at once after an engine call ran past its
        bound (`stalled`): stop the producer with that error (else `RolloutFailedError`) and hand
        those groups back as fresh prompts (so a checkpoint holds them)."""
        streak = self._tally.failure_streak
        if self._producer_error is not None:
            return
        if stalled is None and len(streak) <= self.context.config.batch_size:
            return
        errors = [g[0].metadata.get("error", "") for g in streak if g]
        self._producer_error = stalled or RolloutFailedError(
            self._state.rollout_id if self._state else 0, errors, source=self.failure_source()
        )
        ids = {id(g) for g in streak}
        self._failed = [g for g in self._failed if id(g) not in ids]
        self._give_back(list(streak), fresh=True)
        streak.clear()

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    def _give_back(self, groups: list[list[Sample]], *, fresh: bool) -> None:
        """Hand groups back to the data source (counted as returned) and wake the producer.

        `fresh` resets them to prompts; otherwise partial samples are kept with `partial_rollout`.
        """
        if fresh:
            for g in groups:
                for s in g:
                    reset_sample(s)
        self._hand_back(groups, self._tally)
        self._exhausted = False

    async def _stop_in_flight(self) -> list[list[Sample]]:
        """Abort the producer's requests, wait for its groups; return those that never finished."""
        if self._state is not None:
            self._state.aborted.set()
        in_flight = dict(self._in_flight)
        if not in_flight:
            return []
        assert self._state is not None
        try:
            await self.context.engine.abort(self._state.request_prefix + "-")
        except Exception as exc:  # keep closing: the groups are still handed back
            logger.warning("fully-async close: engine abort failed: %s: %s", type(exc).__name__, exc)
        _, pending = await asyncio.wait(in_flight, timeout=self.abort_grace_s)
        for task in pending:
            task.cancel()
        if pending:
            logger.warning(
                "%d groups ignored the abort for %.0fs; cancelled", len(pending), self.abort_grace_s
            )
            await asyncio.wait(pending)
        return [
            group for task, group in in_flight.items() if task.cancelled() or task.exception() is not None
        ]
