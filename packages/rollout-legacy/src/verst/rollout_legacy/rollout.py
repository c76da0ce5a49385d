"""The v1 rollout entry point, `generate_rollout(args, rollout_id, data_source, evaluation=False)`.

This is the function-based rollout slime and miles users know (slime's
`sglang_rollout.generate_rollout`): a plain synchronous function that owns one rollout from
start to end. It differs from the class-based default (`InferenceRollout`) in control flow and
ABI only — the v1 signature, the v1 `args` namespace, and a function that owns its loop over
over-sampling waves — while every per-sample piece is rollout-core's: `generate_and_rm` /
`generate_and_rm_group` (generation, partial-rollout resume, the off-policy loss mask, rewards,
lifecycle events through the context's sink), the dynamic filters, and the shared log previews.

Where slime reaches its engine through a module-global `GenerateState` singleton, this function
gets a `LegacyRuntime` explicitly (`runtime=`), or from `args.runtime` (the args that
`LegacyRolloutStrategy` builds carry it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from verst.rollout.config import RolloutConfig
from verst.rollout.engine import SamplingParams
from verst.rollout.errors import RolloutFailedError
from verst.rollout.generate import GroupGenerationError, generate_and_rm_group, reset_sample
from verst.rollout.logging_utils import log_first_sample, log_rollout_finish, sample_text_preview
from verst.rollout.protocols import DataSource, GenerateState
from verst.rollout.sample import Sample, Status
from verst.rollout.strategies.filters import DynamicFilter, apply_filters, load_dynamic_filter
from verst.rollout.strategies.inference import RolloutStalledError, max_waves, sample_metrics
from verst.rollout.v1_args import V1Args, build_v1_args
from verst.rollout_legacy.runtime import LegacyRuntime, runtime_of

logger = logging.getLogger(__name__)


@dataclass
class RolloutFnTrainOutput:
    """What a v1 rollout function returns for training (slime/miles `RolloutFnTrainOutput`)."""

    samples: list[list[Sample]]
    """The kept groups, `rollout_batch_size` of them, `n_samples_per_prompt` samples each."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Flat rollout metrics (`rollout/...`)."""


@dataclass
class RolloutFnEvalOutput:
    """What a v1 rollout function returns for evaluation (slime/miles `RolloutFnEvalOutput`)."""

    data: dict[str, list[list[Sample]]]
    """Groups per eval dataset name."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Flat eval metrics (`eval/<name>/...`)."""


def build_legacy_args(runtime: LegacyRuntime) -> V1Args:
    """The read-only v1 args of the runtime's config (plus the context's extra v1 settings such
    as `hf_checkpoint`), carrying the runtime itself as `args.runtime`."""
    return build_v1_args(runtime.config, **{**runtime.context.v1_args, "runtime": runtime})


def generate_rollout(
    args: Any,
    rollout_id: int,
    data_source: DataSource,
    evaluation: bool = False,
    *,
    runtime: LegacyRuntime | None = None,
) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """Generate one rollout (or one evaluation) the v1 way; a plain synchronous function.

    Training: groups of `args.n_samples_per_prompt` samples are submitted in waves of
    `args.over_sampling_batch_size` prompts until `args.rollout_batch_size` groups pass the
    dynamic filters; then in-flight work is aborted and the unfinished groups go back to
    `data_source` (with `partial_rollout`, keeping their partial tokens and
    `metadata["start_rollout_id"]`, to be resumed next rollout; otherwise as fresh prompts).
    Evaluation: every eval dataset of the runtime, one group per prompt.

    `runtime` defaults to `args.runtime`. Runs on the runtime's event loop when it has one
    running in another thread, else in its own `asyncio.run`; never call it from inside a
    running event loop (use `asyncio.to_thread`).
    """
    rt = runtime_of(args, runtime)
    if evaluation:
        return rt.run(_eval_rollout(args, rollout_id, rt))
    return rt.run(_train_rollout(args, rollout_id, rt, data_source))


# --------------------------------------------------------------------------- training


async def _train_rollout(
    args: Any, rollout_id: int, rt: LegacyRuntime, data_source: DataSource
) -> RolloutFnTrainOutput:
    """slime's `generate_rollout_async`: waves of groups until the batch is full, then abort.

    Group outcomes match the default strategy's: kept, dropped by a filter (counted per
    reason; a reward error is reason `reward_error`), FAILED after its retries (not trained
    on, counted), or unfinished (handed back). Unfinished groups and finished groups beyond the
    batch go back to `data_source`; filtered groups are consumed, as in slime.
    """
    started = time.perf_counter()
    state = _new_state(rt, rollout_id, args, evaluation=False)
    waves = _Waves(args, rollout_id, state, _load_filters(rt.config, args), max_waves(rt.config))
    params = sampling_params_from_args(args)
    rt.current_state = state
    try:
        while len(waves.kept) < waves.target and not state.aborted.is_set():
            waves.launch(data_source, params)
            if not waves.in_flight:
                break
            done, _ = await asyncio.wait(waves.in_flight, return_when=asyncio.FIRST_COMPLETED)
            waves.collect(done)
        if not waves.kept and waves.tally["wave_limit_hit"]:
            raise _stall_error(rollout_id, waves.target, waves.tally, waves.wave_limit)
    except RolloutFailedError:
        waves.unused.extend(waves.failed_groups)  # handed back as fresh prompts: none is lost
        raise
    finally:
        waves.unused.extend(await _abort_in_flight(state, rt, waves.in_flight))
        rt.current_state = None
        _hand_back(data_source, waves.unused, rollout_id, args.partial_rollout, waves.tally)
    kept = sorted(waves.kept, key=lambda g: g[0].group_index or 0)
    metrics = _train_metrics(kept, args.reward_key, waves.tally, time.perf_counter() - started)
    if kept and kept[0]:
        log_first_sample(logger, kept[0][0], label=f"v1 rollout {rollout_id}")
    log_rollout_finish(logger, rollout_id, metrics)
    return RolloutFnTrainOutput(samples=kept, metrics=metrics)


@dataclass
class _Waves:
    """One training rollout's groups: launched in waves, then kept, unused, failed or in flight."""

    args: Any
    rollout_id: int
    state: GenerateState
    filters: list[DynamicFilter]
    wave_limit: int
    """`max_waves_per_rollout`: waves pulled at most (every group dropped never cycles forever)."""
    tally: Counter[str] = field(default_factory=Counter)
    kept: list[list[Sample]] = field(default_factory=list)
    unused: list[list[Sample]] = field(default_factory=list)
    """Groups handed back to the data source (unfinished, beyond the batch, failed)."""
    in_flight: dict[asyncio.Task[tuple[list[Sample], bool]], list[Sample]] = field(default_factory=dict)
    failed_groups: list[list[Sample]] = field(default_factory=list)
    next_group: int = 0
    next_sample: int = 0
    exhausted: bool = False

    @property
    def target(self) -> int:
        return self.args.rollout_batch_size

    def launch(self, data_source: DataSource, params: SamplingParams) -> None:
        """slime's `remaining_batch_size < target`: another wave while kept + in flight fall short."""
        wave = self.args.over_sampling_batch_size or self.target
        while not self.exhausted and len(self.kept) + len(self.in_flight) < self.target:
            if self.tally["waves"] >= self.wave_limit:
                self.exhausted = True
                self.tally["wave_limit_hit"] = 1
                logger.warning(
                    "v1 rollout %d: %d waves pulled; stopping (max_waves_per_rollout)",
                    self.rollout_id,
                    self.wave_limit,
                )
                return
            self.tally["waves"] += 1
            groups = data_source.get_samples(wave)
            if not groups:
                self.exhausted = True
                logger.warning("v1 rollout %d: the data source ran out of prompts", self.rollout_id)
            for group in groups:
                _index_group(group, self.next_group, self.next_sample)
                self.next_group, self.next_sample = self.next_group + 1, self.next_sample + len(group)
                task = asyncio.create_task(_group_with_retries(self.state, group, params, False, self.tally))
                self.in_flight[task] = group

    def collect(self, done: set[asyncio.Task[tuple[list[Sample], bool]]]) -> None:
        """Sort the finished groups into failed, unused (the batch is full) or filtered/kept."""
        for task in sorted(done, key=lambda t: self.in_flight[t][0].group_index or 0):
            self.in_flight.pop(task)
            group, failed = task.result()
            if failed:
                self.tally["failed_groups"] += 1
                self.failed_groups.append(group)
                if len(self.failed_groups) > self.target:
                    raise RolloutFailedError(
                        self.rollout_id,
                        [g[0].metadata.get("error", "") for g in self.failed_groups if g],
                        label="v1 rollout",
                    )
            elif len(self.kept) >= self.target:
                self.unused.append(group)
            else:
                _classify(group, self.filters, self.args.reward_key, self.kept, self.unused, self.tally)


def _stall_error(rollout_id: int, target: int, tally: Counter[str], wave_limit: int) -> RolloutStalledError:
    """The default strategy's error when the wave bound is hit with nothing kept."""
    reasons = ", ".join(
        f"{k[len('dropped/') :]}={v}" for k, v in sorted(tally.items()) if k.startswith("dropped/")
    )
    return RolloutStalledError(
        f"v1 rollout {rollout_id}: pulled {tally['waves']} waves ({tally['finished_groups']} groups finished) "
        f"and kept 0 of {target} groups — the others were dropped ({reasons or 'none'}). With nonzero_std "
        "this means the task is solved (all rewards in a group equal); fix: stop training, remove the "
        f"filter from rollout.dynamic_filters, or raise rollout.max_waves_per_rollout (now {wave_limit})"
    )


def _classify(
    group: list[Sample],
    filters: list[DynamicFilter],
    reward_key: str | None,
    kept: list[list[Sample]],
    unused: list[list[Sample]],
    tally: Counter[str],
) -> None:
    """A generated group: hand it back if unfinished, else keep it or drop it (counted per
    reason). Dynamic filters only ever see finished groups."""
    tally["finished_groups"] += 1
    tally["generated_tokens"] += sum(s.response_length for s in group)
    reward_errors = sum(s.status is Status.FAILED for s in group)
    if reward_errors:
        tally["reward_errors"] += reward_errors
        tally["dropped/reward_error"] += 1
        return
    if not all(s.status.is_finished for s in group):
        unused.append(group)  # aborted: handed back; filters only ever see finished groups
        return
    outcome = apply_filters(filters, group)
    if not outcome.keep:
        tally[f"dropped/{outcome.reason or 'filtered'}"] += 1
    else:
        kept.append(group)


async def _group_with_retries(
    state: GenerateState,
    group: list[Sample],
    params: SamplingParams,
    evaluation: bool,
    tally: Counter[str],
) -> tuple[list[Sample], bool]:
    """`generate_and_rm_group`, resubmitting a group whose generation raised up to
    `max_group_retries` times, then marking it FAILED (error in metadata; returned with
    `True`) — never silently dropped."""
    retries = state.config.max_group_retries
    for attempt in range(retries + 1):
        try:
            return await generate_and_rm_group(state, group, params, evaluation), False
        except GroupGenerationError as exc:
            last = attempt == retries or not getattr(exc.cause, "retryable", True)  # a 4xx fails again
            first = group[0] if group else None
            logger.warning(
                "v1 rollout %d: group %s failed (%s: %s) — %s; prompt=%r",
                state.rollout_id,
                first.group_index if first else None,
                type(exc.cause).__name__,
                sample_text_preview(str(exc.cause), 300),
                "giving up, marking it FAILED" if last else "resubmitting",
                sample_text_preview(first.prompt if first else ""),
            )
            if last:
                error = f"generate: {type(exc.cause).__name__}: {sample_text_preview(str(exc.cause), 300)}"
                for sample in group:
                    sample.status = Status.FAILED
                    sample.metadata["error"] = error
                return group, True
            tally["group_retries"] += 1
            for sample in group:
                reset_sample(sample, keep_attempt=True)
    raise AssertionError("unreachable")  # pragma: no cover


async def _abort_in_flight(
    state: GenerateState,
    rt: LegacyRuntime,
    in_flight: dict[asyncio.Task[tuple[list[Sample], bool]], list[Sample]],
) -> list[list[Sample]]:
    """Abort this rollout's engine requests and collect the groups that were in flight."""
    state.aborted.set()
    if not in_flight:
        return []
    try:
        await rt.engine.abort(state.request_prefix + "-")
    finally:
        await asyncio.wait(in_flight)
    groups = []
    for task, group in in_flight.items():
        if task.cancelled() or task.exception() is not None:
            groups.append(group)
        else:
            groups.append(task.result()[0])
    in_flight.clear()
    return groups


def _hand_back(
    data_source: DataSource,
    groups: list[list[Sample]],
    rollout_id: int,
    partial: bool,
    tally: Counter[str],
) -> None:
    """Return unused groups to the data source: with partial rollout as they are (partial
    tokens and `start_rollout_id` kept, to be resumed next rollout), otherwise as fresh prompts."""
    if not groups:
        return
    for group in groups:
        for sample in group:
            if sample.status is Status.ABORTED:
                tally["aborted"] += 1
            if not partial or sample.status is Status.FAILED:
                reset_sample(sample)
                continue
            sample.metadata.pop("error", None)
            if not sample.status.is_finished and sample.response_length:
                sample.metadata.setdefault("start_rollout_id", rollout_id)
    tally["returned_groups"] += len(groups)
    data_source.add_samples(groups)


def _load_filters(config: RolloutConfig, args: Any) -> list[DynamicFilter]:
    """The config's dynamic filters (slime's `dynamic_sampling_filter_path` is among them)."""
    names = list(config.dynamic_filters)
    v1_path = getattr(args, "dynamic_sampling_filter_path", None)
    if v1_path and v1_path not in names:
        names.insert(0, v1_path)
    return [load_dynamic_filter(name, args.reward_key) for name in names]


def _train_metrics(
    kept: list[list[Sample]], reward_key: str | None, tally: Counter[str], elapsed: float
) -> dict[str, float]:
    """The default strategy's rollout metrics (same names), from the kept groups and the tally."""
    metrics = sample_metrics([s for g in kept for s in g], reward_key, "rollout")
    metrics["rollout/kept_groups"] = float(len(kept))
    metrics["rollout/dropped_groups"] = float(sum(v for k, v in tally.items() if k.startswith("dropped/")))
    for key in (
        "failed_groups",
        "group_retries",
        "reward_errors",
        "returned_groups",
        "aborted",
        "waves",
        "wave_limit_hit",
    ):
        metrics[f"rollout/{key}"] = float(tally[key])
    metrics["rollout/generated_tokens"] = float(tally["generated_tokens"])
    metrics["rollout/time_s"] = elapsed
    metrics["rollout/tokens_per_s"] = tally["generated_tokens"] / elapsed if elapsed > 0 else 0.0
    metrics.update({f"rollout/{k}": float(v) for k, v in tally.items() if k.startswith("dropped/")})
    return metrics


# --------------------------------------------------------------------------- evaluation


async def _eval_rollout(args: Any, rollout_id: int, rt: LegacyRuntime) -> RolloutFnEvalOutput:
    """slime's `eval_rollout`: every eval dataset, one group per prompt, at eval sampling."""
    params = sampling_params_from_args(args, evaluation=True)
    state = _new_state(rt, rollout_id, args, evaluation=True)
    tally: Counter[str] = Counter()
    data: dict[str, list[list[Sample]]] = {}
    metrics: dict[str, float] = {}
    rt.current_state = state
    try:
        for name, prompts in rt.eval_datasets.items():
            ds = rt.config.eval.datasets.get(name)
            n = ds.n_samples_per_prompt if ds is not None else 1
            groups = []
            for gi, prompt in enumerate(prompts):
                group = [reset_sample(prompt.clone()) for _ in range(n)]
                _index_group(group, gi, gi * n)
                groups.append(group)
            done = await asyncio.gather(*(_group_with_retries(state, g, params, True, tally) for g in groups))
            data[name] = [group for group, _ in done]
            samples = [s for g in data[name] for s in g]
            metrics.update(sample_metrics(samples, args.reward_key, f"eval/{name}"))
            metrics[f"eval/{name}/failed_samples"] = float(sum(s.status is Status.FAILED for s in samples))
            if samples:
                log_first_sample(logger, samples[0], label=f"v1 eval {name} {rollout_id}")
    finally:
        rt.current_state = None
    log_rollout_finish(logger, rollout_id, metrics)
    return RolloutFnEvalOutput(data=data, metrics=metrics)


# --------------------------------------------------------------------------- helpers


def sampling_params_from_args(args: Any, evaluation: bool = False) -> SamplingParams:
    """The sampling params of a v1 rollout, read from the v1 args (slime's names)."""
    max_new = args.rollout_max_response_len
    temperature = args.rollout_temperature
    if evaluation:
        max_new = getattr(args, "eval_max_response_len", None) or max_new
        temperature = getattr(args, "eval_temperature", temperature)
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=args.rollout_top_p,
        top_k=args.rollout_top_k,
        stop=tuple(args.rollout_stop or ()),
        stop_token_ids=tuple(args.rollout_stop_token_ids or ()),
        sampling_seed=args.rollout_seed,
    )


def _new_state(rt: LegacyRuntime, rollout_id: int, args: Any, *, evaluation: bool) -> GenerateState:
    """The per-rollout `GenerateState` (the strategy's generate function, a fresh semaphore)."""
    concurrency = getattr(args, "sglang_server_concurrency", None) or rt.config.max_concurrency
    return GenerateState(
        context=rt.generate_context,
        rollout_id=rollout_id,
        weight_version=rt.weight_version,
        semaphore=asyncio.Semaphore(concurrency),
        request_prefix=f"v1{'e' if evaluation else 'r'}{rollout_id}",
        generate_fn=rt.generate_fn(args),
        generate_fn_cache=rt.generate_fn_cache,
    )


def _index_group(group: list[Sample], group_index: int, first_sample_index: int) -> None:
    for j, sample in enumerate(group):
        sample.group_index = group_index
        sample.sample_index = first_sample_index + j
