"""`InferenceRollout`: the default, class-based rollout strategy.

One training rollout:

1. Pull `over_sampling_batch_size` groups at a time from the data source and submit each group
   as a task (`generate_and_rm_group`); the semaphore inside `generate_and_rm` bounds engine
   requests. Waves keep coming while the kept groups plus the groups in flight fall short of
   `batch_size`.
2. As groups finish, apply the dynamic filters (drops are counted per reason,
   `rollout/dropped/<reason>`). A group whose generation raised (`GroupGenerationError`) is
   logged and resubmitted up to `max_group_retries` times, then its samples are marked FAILED
   with the error in their metadata and counted (`rollout/failed_groups`) — never trained on,
   never silently dropped. A group whose cause is not retryable (`EngineError.retryable` False:
   a 4xx such as a prompt longer than the context) is marked FAILED at once. When more groups
   fail in a row (FAILED, or dropped for a reward error) than one batch holds, the rollout raises
   `RolloutFailedError` naming the engine, the functions and the last error — and hands every
   group in play back to the data source.
3. At most `max_waves_per_rollout` waves are pulled (default 10 × the waves one batch needs):
   when every group is filtered (e.g. `nonzero_std` on a solved task) the rollout returns the
   groups it kept (`rollout/wave_limit_hit = 1`), or raises `RolloutStalledError` naming the
   drop reasons when it kept none — never cycling the dataset forever.
4. Once `batch_size` groups are kept: set `state.aborted`, abort this rollout's engine requests
   by their id prefix, wait for the groups in flight, and hand every unused group back to the
   data source — with `partial_rollout` as they are (ABORTED samples keep their partial tokens
   and `start_rollout_id`), otherwise reset to fresh prompts. None is lost.

An eval request runs every dataset in `context.eval_datasets` (no lifecycle events; each scored
by its own `rollout.eval.datasets.<name>.reward` when set, `evaluation.Evaluator`) and returns
`RolloutResult(eval={name: groups}, metrics={"eval/<name>/reward_mean": ...})`.

Model rewards' counters (a judge's calls, cache hits, errors) join each rollout's metrics as
what that rollout added: `reward/judge/calls`, ... (`rewards.counters`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any, ClassVar

from verst.rollout.agentic.episode import episode_generate_fn
from verst.rollout.agentic.trajectory import generated_token_count
from verst.rollout.engine import EngineTimeout
from verst.rollout.errors import RolloutError, RolloutFailedError
from verst.rollout.generate import (
    GroupGenerationError,
    SingleTurnGenerate,
    reset_sample,
)
from verst.rollout.loading import load_generate_function
from verst.rollout.logging_utils import log_first_sample, log_rollout_finish, sample_text_preview
from verst.rollout.protocols import (
    Capability,
    GenerateFn,
    GenerateState,
    RolloutContext,
    RolloutRequest,
    RolloutResult,
)
from verst.rollout.rewards.counters import RewardCounters
from verst.rollout.sample import Sample, Status
from verst.rollout.sampling import sampling_params_for
from verst.rollout.strategies.evaluation import Evaluator
from verst.rollout.strategies.filters import DynamicFilter, apply_filters, load_dynamic_filter
from verst.rollout.strategies.metrics import sample_metrics
from verst.rollout.strategies.rollout_state import (
    RolloutRun,
    RolloutTally,
    group_of,
    mark_failed,
    retryable,
)

logger = logging.getLogger(__name__)

STATE_VERSION = 1
"""Version of `InferenceRollout.state_dict()`'s layout."""


class RolloutStalledError(RolloutError):
    """A rollout pulled `max_waves_per_rollout` waves and kept no group (all were dropped)."""


def max_waves(config: Any) -> int:
    """Waves one training rollout may pull: `max_waves_per_rollout`, or 10 × the waves a batch needs."""
    if config.max_waves_per_rollout is not None:
        return int(config.max_waves_per_rollout)
    wave = config.effective_over_sampling_batch_size
    return 10 * -(-config.batch_size // wave)


class InferenceRollout:
    """The default strategy (see the module docstring).

    It takes a `RolloutContext` rather than the trainer or an argparse namespace: the context
    is everything a rollout needs (config, data source, engine, tokenizer, rewards, sink), so
    the same object runs in the driver or inside a Ray actor.
    """

    capabilities: ClassVar[frozenset[Capability]] = frozenset(Capability) - {Capability.FULLY_ASYNC}
    abort_grace_s: ClassVar[float] = 60.0
    """Seconds to wait for in-flight groups after the engine abort before cancelling them."""
    cancel_grace_s: ClassVar[float] = 3.0
    """The same wait when the rollout itself is cancelled (a stop request must end in seconds)."""

    def __init__(self, context: RolloutContext) -> None:
        self.context = context
        """What the strategy was built from."""
        config = context.config
        self.generate_fn: GenerateFn = (
            load_generate_function(config.generate_function_path, config, v1_args=context.v1_args)
            if config.generate_function_path
            else episode_generate_fn(context)
            if config.env is not None
            else SingleTurnGenerate()
        )
        """The generate function of every sample without its own `generate_function_path`."""
        self.filters: list[DynamicFilter] = [
            load_dynamic_filter(name, config.reward.key) for name in config.dynamic_filters
        ]
        """Dynamic filters, applied in order (the first rejection wins)."""
        self.last_failed_groups: list[list[Sample]] = []
        """Groups of the last rollout that failed after their retries (FAILED, error in metadata)."""
        self._generate_fn_cache: dict[str, GenerateFn] = {}
        self._prefix = f"verst-{secrets.token_hex(4)}"
        self._counters: dict[str, int] = {"rollouts": 0, "evals": 0, "kept_groups": 0, "failed_groups": 0}
        self.reward_counters = RewardCounters([context.reward_fn, context.group_reward_fn])
        """Per-rollout counters of model rewards (`reward/judge/calls`, ...; `rewards.counters`)."""
        self.evaluator = Evaluator(context)
        """Eval requests, each dataset scored by its own reward when it names one."""

    # ------------------------------------------------------------------ protocol

    async def __call__(self, request: RolloutRequest) -> RolloutResult:
        if request.evaluation:
            return await self._evaluate(request)
        return await self._rollout(request)

    async def _evaluate(self, request: RolloutRequest) -> RolloutResult:
        """An eval over every eval dataset (`evaluation.Evaluator`)."""
        result = await self.evaluator(self, request)
        self._counters["evals"] += 1
        return result

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "counters": dict(self._counters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"InferenceRollout state has version {state.get('version')!r}, expected {STATE_VERSION}; "
                f"it was saved by an incompatible verst version"
            )
        self._counters.update(state["counters"])

    async def close(self) -> None:
        """Nothing runs between calls; close loaded generate functions that have a `close` and
        reward functions that have an `aclose` (a judge's engine, a remote reward's session)."""
        for fn in [self.generate_fn, *self._generate_fn_cache.values()]:
            close = getattr(fn, "close", None)
            if close is not None:
                out = close()
                if asyncio.iscoroutine(out):
                    await out
        self._generate_fn_cache.clear()
        group_inner = getattr(self.context.group_reward_fn, "reward_fn", None)
        for reward in (self.context.reward_fn, group_inner):  # a judge's engine, an HTTP session
            aclose = getattr(reward, "aclose", None)
            if aclose is not None:
                await aclose()
        await self.evaluator.aclose()

    # ------------------------------------------------------------------ helpers

    def new_state(self, request: RolloutRequest, tag: str, *, per_rollout: bool = True) -> GenerateState:
        """The `GenerateState` of `request`; its request ids start `<prefix>-<tag><rollout id>`
        (`per_rollout`), or `<prefix>-<tag>` for a state that outlives rollouts (fully async)."""
        return GenerateState(
            context=self.context,
            rollout_id=request.rollout_id,
            weight_version=request.weight_version,
            semaphore=asyncio.Semaphore(self.context.config.max_concurrency),
            request_prefix=f"{self._prefix}-{tag}{request.rollout_id if per_rollout else ''}",
            generate_fn=self.generate_fn,
            generate_fn_cache=self._generate_fn_cache,
        )

    def failure_source(self) -> str:
        """What a failing group may have failed in: the engine and the user functions."""
        config = self.context.config
        engine = repr(self.context.engine)
        if " object at 0x" in engine:  # no useful repr: the class is what the user configured
            engine = type(self.context.engine).__name__
        parts = [f"engine: {engine}"]
        if config.env is not None:
            parts.append(f"environment: rollout.env.type={config.env.type!r} (episode loop AgenticGenerate)")
        else:
            default = "SingleTurnGenerate (default)"
            parts.append(f"generate function: {config.generate_function_path or default}")
        parts.append(f"reward: {config.reward.type}")
        return "; ".join(parts)

    def _check_failures(self, tally: RolloutTally, rollout_id: int) -> None:
        """Raise `RolloutFailedError` once more groups failed in a row than one batch holds."""
        if len(tally.failure_streak) > self.context.config.batch_size:
            errors = [g[0].metadata.get("error", "") for g in tally.failure_streak if g]
            raise RolloutFailedError(rollout_id, errors, source=self.failure_source())

    def _stall_error(
        self, rollout_id: int, kept: int, tally: RolloutTally, unfinished: int = 0
    ) -> RolloutStalledError:
        config = self.context.config
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(tally.dropped.items())) or "none"
        return RolloutStalledError(
            f"rollout {rollout_id}: pulled {tally.waves} waves ({tally.finished_groups} groups finished) and "
            f"kept {kept} of {config.batch_size} groups — the others were dropped ({reasons}) or came "
            f"back unfinished ({unfinished}, aborted by the engine). "
            f"With nonzero_std this means the task is solved (all rewards in a group equal); fix: stop "
            f"training, remove the filter from rollout.dynamic_filters, or raise "
            f"rollout.max_waves_per_rollout (now {max_waves(config)})"
        )

    def log_group_failure(self, err: GroupGenerationError, retry: bool) -> None:
        first = err.group[0] if err.group else None
        logger.warning(
            "group %s failed (%s: %s) — %s; prompt=%r",
            first.group_index if first else None,
            type(err.cause).__name__,
            sample_text_preview(str(err.cause), 300),
            "resubmitting" if retry else "giving up, marking it FAILED",
            sample_text_preview(first.prompt if first else ""),
        )

    def _hand_back(self, groups: list[list[Sample]], tally: RolloutTally) -> None:
        """Return unused groups to the data source (partial samples kept only with partial_rollout)."""
        if not groups:
            return
        partial = self.context.config.partial_rollout
        for group in groups:
            for s in group:
                if s.status is Status.ABORTED:
                    tally.aborted_samples += 1
                if not partial or s.status is Status.FAILED:
                    reset_sample(s)
                else:
                    s.metadata.pop("error", None)
        tally.returned_groups += len(groups)
        self.context.data_source.add_samples(groups)

    # ------------------------------------------------------------------ training rollout

    async def _rollout(self, request: RolloutRequest) -> RolloutResult:
        """One training rollout: fill the batch, then abort what is left and hand it back."""
        started = time.perf_counter()
        run = RolloutRun(request, self.new_state(request, "r"), sampling_params_for(self.context.config))
        completed, grace = False, self.abort_grace_s
        try:
            await self._fill(run)
            completed = True
        except RolloutError:
            run.requeue_failures()
            raise
        except asyncio.CancelledError:
            grace = self.cancel_grace_s
            raise
        finally:
            await self._end(run, grace, completed=completed)
        return self._rollout_result(run, started)

    async def _fill(self, run: RolloutRun) -> None:
        """Pull waves and collect finished groups until the batch is full or nothing is in flight."""
        target = self.context.config.batch_size
        while len(run.kept) < target:
            self._pull(run)
            if not run.in_flight:
                break
            for task in await run.next_done():
                self._collect(run, task)
        if not run.kept and run.tally.wave_limit_hit:
            raise self._stall_error(run.request.rollout_id, 0, run.tally, len(run.unused))

    def _pull(self, run: RolloutRun) -> None:
        """Submit waves while kept + in-flight groups fall short of the batch (at most `max_waves`)."""
        config = self.context.config
        target, tally = config.batch_size, run.tally
        while not run.exhausted and len(run.kept) + len(run.in_flight) < target:
            if tally.waves >= max_waves(config):
                run.exhausted = tally.wave_limit_hit = True
                logger.warning(
                    "rollout %d: %d waves pulled, %d of %d groups kept; stopping (max_waves_per_rollout)",
                    run.request.rollout_id,
                    tally.waves,
                    len(run.kept),
                    target,
                )
                return
            tally.waves += 1
            groups = self.context.data_source.get_samples(config.effective_over_sampling_batch_size)
            if not groups:
                run.exhausted = True
                logger.warning("rollout %d: the data source ran out of prompts", run.request.rollout_id)
            for group in groups:
                run.submit(run.numbered(group))

    def _collect(self, run: RolloutRun, task: asyncio.Task[list[Sample]]) -> None:
        """A finished group: unused once the batch is full, retried or FAILED after a generation
        error, else kept or dropped (`_classify`). Any other error stops the rollout."""
        group = run.in_flight.pop(task)
        if len(run.kept) >= self.context.config.batch_size:
            run.unused.append(group_of(task, group))
            return
        error = task.exception()
        if isinstance(error, GroupGenerationError):
            self._retry_or_fail(run, group, error)
            return
        if error is not None:
            run.unused.append(group)
            raise error
        self._classify(task.result(), run.kept, run.unused, run.tally)
        self._check_failures(run.tally, run.request.rollout_id)

    def _retry_or_fail(self, run: RolloutRun, group: list[Sample], error: GroupGenerationError) -> None:
        """Resubmit a group whose generation raised (up to `max_group_retries`), else mark it FAILED."""
        used = run.retries.get(group[0].group_index, 0)
        retry = used < self.context.config.max_group_retries and retryable(error)
        self.log_group_failure(error, retry)
        if retry:
            run.retries[group[0].group_index] = used + 1
            run.tally.group_retries += 1
            run.submit([reset_sample(s, keep_attempt=True) for s in group])
        else:
            run.failed.append(mark_failed(group, error))
            run.tally.failure_streak.append(group)
            if isinstance(error.cause, EngineTimeout):  # an engine call ran past its bound: stop now
                raise error.cause
            self._check_failures(run.tally, run.request.rollout_id)

    async def _end(self, run: RolloutRun, grace: float, *, completed: bool) -> None:
        """Abort the groups in flight and hand back every group not returned — the kept ones too
        when the rollout raises. An abort that fails only raises after a completed rollout."""
        run.state.aborted.set()
        drained = False
        try:
            await self._drain(run.state, run.in_flight, grace)
            drained = True
        except Exception as exc:
            if completed:
                raise
            # the rollout is already failing (e.g. a dead engine): keep its error, not the abort's
            logger.warning(
                "rollout %d: engine abort failed: %s: %s", run.request.rollout_id, type(exc).__name__, exc
            )
        finally:  # even if the abort itself failed: no group is lost
            run.unused.extend(group_of(task, group) for task, group in run.in_flight.items())
            if not (completed and drained):  # the rollout raises: its kept groups go back too
                run.unused.extend(run.kept)
            self._hand_back(run.unused, run.tally)

    def _rollout_result(self, run: RolloutRun, started: float) -> RolloutResult:
        """The kept groups with their metrics; counters and the end-of-rollout log."""
        kept, failed = run.kept, run.failed
        self.last_failed_groups = failed
        result = RolloutResult(groups=kept, metrics=self._metrics(kept, failed, run.tally, started))
        self._counters["rollouts"] += 1
        self._counters["kept_groups"] += len(kept)
        self._counters["failed_groups"] += len(failed)
        if kept:
            log_first_sample(logger, kept[0][0], label=f"rollout {run.request.rollout_id}")
        log_rollout_finish(logger, run.request.rollout_id, result.metrics)
        return result

    def _classify(
        self, samples: list[Sample], kept: list[list[Sample]], unused: list[list[Sample]], tally: RolloutTally
    ) -> None:
        """A generated group: hand it back if unfinished (some sample aborted), else keep it or
        drop it (counted per reason). Dynamic filters only ever see finished groups."""
        tally.finished_groups += 1
        tally.generated_tokens += sum(generated_token_count(s) for s in samples)
        reward_errors = sum(s.status is Status.FAILED for s in samples)
        if reward_errors:
            tally.reward_errors += reward_errors
            tally.dropped["reward_error"] = tally.dropped.get("reward_error", 0) + 1
            tally.failure_streak.append(samples)
            return
        if not all(s.status.is_finished for s in samples):
            unused.append(samples)  # aborted: handed back; filters only ever see finished groups
            return
        tally.failure_streak.clear()  # generated and scored: whatever the filters say, it works
        outcome = apply_filters(self.filters, samples)
        if not outcome.keep:
            reason = outcome.reason or "filtered"
            tally.dropped[reason] = tally.dropped.get(reason, 0) + 1
            return
        kept.append(samples)

    async def _drain(
        self,
        state: GenerateState,
        in_flight: dict[asyncio.Task[list[Sample]], list[Sample]],
        grace: float | None = None,
    ) -> None:
        """Abort this rollout's requests and wait (up to `grace` s) for the groups in flight."""
        if not in_flight:
            return
        grace = self.abort_grace_s if grace is None else grace
        try:
            await asyncio.wait_for(self.context.engine.abort(state.request_prefix + "-"), grace)
        finally:
            _, pending = await asyncio.wait(in_flight, timeout=grace)
            for task in pending:
                task.cancel()
            if pending:
                logger.warning("%d groups ignored the abort for %.0fs; cancelled", len(pending), grace)
                await asyncio.wait(pending)

    def _metrics(
        self, kept: list[list[Sample]], failed: list[list[Sample]], tally: RolloutTally, started: float
    ) -> dict[str, float]:
        samples = [s for g in kept for s in g]
        elapsed = time.perf_counter() - started
        metrics = sample_metrics(samples, self.context.config.reward.key, "rollout")
        metrics.update(
            {
                "rollout/kept_groups": float(len(kept)),
                "rollout/dropped_groups": float(sum(tally.dropped.values())),
                "rollout/failed_groups": float(len(failed)),
                "rollout/group_retries": float(tally.group_retries),
                "rollout/reward_errors": float(tally.reward_errors),
                "rollout/returned_groups": float(tally.returned_groups),
                "rollout/aborted": float(tally.aborted_samples),
                "rollout/waves": float(tally.waves),
                "rollout/wave_limit_hit": float(tally.wave_limit_hit),
                "rollout/generated_tokens": float(tally.generated_tokens),
                "rollout/time_s": elapsed,
                "rollout/tokens_per_s": tally.generated_tokens / elapsed if elapsed > 0 else 0.0,
            }
        )
        metrics.update(self.reward_counters.delta())
        for reason, count in tally.dropped.items():
            metrics[f"rollout/dropped/{reason}"] = float(count)
        return metrics
