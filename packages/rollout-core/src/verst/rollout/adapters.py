"""Adapters that run v1-ABI user functions (slime / miles style) on the default path.

- `LegacyRolloutFnAdapter`: a rollout function `fn(args, rollout_id, data_source,
  evaluation=False)`, sync or async, becomes a `RolloutStrategy`. A sync function runs in a
  worker thread (it may call `asyncio.run` itself). Its result — a list of groups, a flat list
  of samples, a dict with `"groups"`/`"samples"` and `"metrics"`, or an object with `.samples`
  / `.metrics` — is boxed into a `RolloutResult`.
- `LegacyGenerateFnAdapter`: a generate function `async fn(args, sample, sampling_params[,
  evaluation])` becomes a `GenerateFn`; it gets a read-only `V1Args`, the sample, and a
  SGLang-style sampling dict.
- `LegacyRewardFnAdapter`: a reward function `async fn(args, sample)` (or, for group rewards,
  `async fn(args, samples)`) becomes a `RewardFn` / `GroupRewardFn`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import statistics
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from verst.rollout.logging_utils import log_first_sample, log_rollout_finish
from verst.rollout.protocols import (
    Capability,
    GenerateInput,
    RewardValue,
    RolloutContext,
    RolloutRequest,
    RolloutResult,
)
from verst.rollout.sample import Sample, SampleInvariantError, Status
from verst.rollout.v1_args import V1Args, build_v1_args

logger = logging.getLogger(__name__)


async def _call_maybe_async(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Await an async function; run a sync one in a worker thread (await what it returns if awaitable)."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):  # noqa: B004
        return await fn(*args, **kwargs)
    out = await asyncio.to_thread(fn, *args, **kwargs)
    if inspect.isawaitable(out):
        out = await out
    return out


class BadSampleError(ValueError):
    """A user function returned a sample in a state the trainer cannot use; the message names
    the function and the field. Deterministic, so the group is not resubmitted."""

    retryable = False


SLIME_ONLY_FIELDS = (
    "remove_sample",
    "multimodal_inputs",
    "multimodal_train_inputs",
    "rollout_routed_experts",
    "rollout_top_p_token_ids",
    "train_metadata",
)
"""slime `Sample` fields verst does not act on: setting one is an error, not silently ignored."""


def check_returned_sample(sample: Any, where: str) -> None:
    """Raise `BadSampleError` naming `where` and the field when `sample` cannot be trained on."""
    if not isinstance(sample, Sample):
        raise BadSampleError(f"{where} returned a {type(sample).__name__}, not a Sample")
    problem = None
    if not isinstance(sample.status, Status):
        problem = f"Sample.status is {sample.status!r}; use Sample.Status.COMPLETED / TRUNCATED / ABORTED"
    elif sample.status is Status.PENDING:
        problem = (
            "Sample.status is PENDING; set it to Sample.Status.COMPLETED (or TRUNCATED, ABORTED, "
            "FAILED) once the response is generated"
        )
    elif sample.status is not Status.FAILED and not sample.tokens:
        problem = "Sample.tokens is empty; set it to the prompt token ids followed by the response ids"
    elif sample.response_length > 0 and sample.prompt_length < 1:
        problem = (
            f"Sample.tokens holds only the response ({len(sample.tokens)} tokens = response_length); "
            f"put the prompt token ids before the response ids"
        )
    else:
        extra = [k for k in SLIME_ONLY_FIELDS if vars(sample).get(k)]
        if extra:
            problem = f"Sample.{extra[0]} is set, and verst does not support it; leave it unset"
        else:
            try:
                sample.validate()
            except SampleInvariantError as exc:
                problem = str(exc)
    if problem:
        raise BadSampleError(f"{where} returned sample {sample.sample_index} in a bad state: {problem}")


def accepts_keyword(fn: Callable[..., Any], name: str) -> bool:
    """True if `fn` takes a parameter `name` (or `**kwargs`)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class LegacyGenerateFnAdapter:
    """Runs a v1 generate function `async fn(args, sample, sampling_params[, evaluation])`."""

    def __init__(self, fn: Callable[..., Any], args: V1Args, *, path: str = "") -> None:
        self.fn = fn
        """The user's v1 generate function."""
        self.args = args
        """The read-only v1 `args` passed as its first argument."""
        self.path = path
        """Where it was loaded from (for messages)."""
        self._takes_evaluation = accepts_keyword(fn, "evaluation")

    async def __call__(self, inp: GenerateInput) -> Sample | list[Sample]:
        kwargs = {"evaluation": inp.evaluation} if self._takes_evaluation else {}
        out = await _call_maybe_async(
            self.fn, self.args, inp.sample, inp.sampling_params.to_sglang(), **kwargs
        )
        if not isinstance(out, Sample | list):
            raise TypeError(
                f"v1 generate function {self.path or self.fn!r} returned {type(out).__name__}; "
                f"it must return the sample (a multi-turn episode is one sample with its own loss mask)"
            )
        for s in out if isinstance(out, list) else (out,):
            check_returned_sample(s, f"v1 generate function {self.path or self.fn!r}")
        return out

    def __repr__(self) -> str:
        return f"LegacyGenerateFnAdapter({self.path or self.fn!r})"


class LegacyRewardFnAdapter:
    """Runs a v1 reward function `async fn(args, sample)` (or `fn(args, samples)` for group rewards)."""

    def __init__(self, fn: Callable[..., Any], args: V1Args, *, path: str = "") -> None:
        self.fn = fn
        """The user's v1 reward function."""
        self.args = args
        """The read-only v1 `args` passed as its first argument."""
        self.path = path
        """Where it was loaded from (for messages)."""

    async def __call__(self, sample_or_samples: Any) -> Any:
        return await _call_maybe_async(self.fn, self.args, sample_or_samples)


def _flat_samples(items: list[Any]) -> list[Sample]:
    return [s for item in items for s in (item if isinstance(item, list) else [item])]


def samples_to_groups(items: Any, n_per_group: int) -> list[list[Sample]]:
    """A v1 result (groups, or a flat list of samples) as a list of groups.

    A flat list is grouped by `group_index` when every sample has one, else cut into chunks of
    `n_per_group`.
    """
    items = list(items)
    if not items:
        return []
    if all(isinstance(x, list) for x in items):
        return [list(g) for g in items]
    flat = _flat_samples(items)
    bad = [type(s).__name__ for s in flat if not isinstance(s, Sample)]
    if bad:
        raise TypeError(f"v1 rollout function returned {bad[0]} items; expected Sample objects or groups")
    if all(s.group_index is not None for s in flat):
        by_group: dict[int, list[Sample]] = {}
        for s in flat:
            by_group.setdefault(s.group_index, []).append(s)  # type: ignore[arg-type]
        return list(by_group.values())
    n = max(1, n_per_group)
    return [flat[i : i + n] for i in range(0, len(flat), n)]


def _reward_mean(groups: list[list[Sample]], reward_key: str | None) -> float | None:
    rewards = [s.scalar_reward(reward_key) for g in groups for s in g if s.reward is not None]
    return statistics.fmean(rewards) if rewards else None


def _unbox(out: Any) -> tuple[Any, dict[str, float]]:
    """(samples or groups, metrics) from any v1 result shape."""
    if isinstance(out, RolloutResult):
        return out.groups, dict(out.metrics)
    if isinstance(out, Mapping):
        for key in ("groups", "samples", "data"):
            if key in out:
                return out[key], dict(out.get("metrics") or {})
        raise TypeError(
            f"v1 rollout function returned a dict with keys {sorted(out)}; expected 'samples' or "
            f"'groups' (and optionally 'metrics'), or a bare list of groups"
        )
    if hasattr(out, "samples"):
        return out.samples, dict(getattr(out, "metrics", None) or {})
    if isinstance(out, list | tuple):
        return out, {}
    raise TypeError(
        f"v1 rollout function returned {type(out).__name__}; expected a list of groups, a list of "
        f"samples, or a dict with 'samples'/'groups' and 'metrics'"
    )


class LegacyRolloutFnAdapter:
    """A v1 rollout function `fn(args, rollout_id, data_source, evaluation=False)` as a strategy.

    The function does its own generation, so the strategy can only promise what every such
    function does: training rollouts and (if it takes `evaluation`) eval rollouts. Features
    such as partial rollout or dynamic filters are the function's business; config validation
    refuses them for this strategy rather than silently ignoring them.
    """

    capabilities: ClassVar[frozenset[Capability]] = frozenset({Capability.EVAL})

    def __init__(self, fn: Callable[..., Any], context: RolloutContext, *, path: str = "") -> None:
        self.fn = fn
        """The user's v1 rollout function."""
        self.context = context
        """The strategy context (its data source is handed to the function)."""
        self.path = path
        """Where it was loaded from (for messages)."""
        self.args = build_v1_args(context.config, **dict(context.v1_args))
        """The read-only v1 `args`."""
        self._takes_evaluation = accepts_keyword(fn, "evaluation")

    async def __call__(self, request: RolloutRequest) -> RolloutResult:
        kwargs: dict[str, Any] = {}
        if request.evaluation:
            if not self._takes_evaluation:
                raise TypeError(
                    f"v1 rollout function {self.path or self.fn!r} has no 'evaluation' parameter, so it "
                    f"cannot run eval rollouts; add `evaluation=False` to its signature or disable eval"
                )
            kwargs["evaluation"] = True
        out = await _call_maybe_async(
            self.fn, self.args, request.rollout_id, self.context.data_source, **kwargs
        )
        result = self._box_eval(out) if request.evaluation else self._box_train(out)
        first = next((s for g in (result.groups or _first_eval(result)) for s in g), None)
        if first is not None:
            log_first_sample(logger, first, label=f"v1 rollout {request.rollout_id}")
        log_rollout_finish(logger, request.rollout_id, result.metrics)
        return result

    def _box_train(self, out: Any) -> RolloutResult:
        items, metrics = _unbox(out)
        groups = samples_to_groups(items, self.context.config.n_samples_per_prompt)
        for s in (s for g in groups for s in g):
            check_returned_sample(s, f"v1 rollout function {self.path or self.fn!r}")
        mean = _reward_mean(groups, self.context.config.reward.key)
        if mean is not None:
            metrics.setdefault("rollout/reward_mean", mean)
        metrics.setdefault("rollout/kept_groups", float(len(groups)))
        return RolloutResult(groups=groups, metrics=metrics)

    def _box_eval(self, out: Any) -> RolloutResult:
        if isinstance(out, RolloutResult):
            return out
        extra_metrics: dict[str, float] = {}
        if not isinstance(out, Mapping) and isinstance(getattr(out, "data", None), Mapping):
            extra_metrics = dict(getattr(out, "metrics", None) or {})  # slime's RolloutFnEvalOutput
            out = out.data
        per_name = out.get("eval", out) if isinstance(out, Mapping) else None
        if not isinstance(per_name, Mapping):
            raise TypeError(
                f"v1 rollout function returned {type(out).__name__} for an eval rollout; expected a "
                f"dict {{dataset_name: samples or {{'samples': ...}}}}"
            )
        result = RolloutResult(metrics=extra_metrics)
        for name, value in per_name.items():
            if name == "metrics":
                continue
            items, metrics = _unbox(value)
            n = (
                self.context.config.eval.datasets[name].n_samples_per_prompt
                if name in self.context.config.eval.datasets
                else 1
            )
            groups = samples_to_groups(items, n)
            rewards = value.get("rewards") if isinstance(value, Mapping) else None
            flat = [s for g in groups for s in g]
            if isinstance(rewards, list) and len(rewards) == len(flat):  # slime's eval shape
                for s, r in zip(flat, rewards, strict=True):
                    if s.reward is None:
                        s.reward = r
            result.eval[name] = groups
            result.metrics.update(metrics)
            mean = _reward_mean(groups, self.context.config.reward.key)
            if mean is not None:
                result.metrics.setdefault(f"eval/{name}/reward_mean", mean)
        return result

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    async def close(self) -> None:
        pass


def _first_eval(result: RolloutResult) -> list[list[Sample]]:
    return next(iter(result.eval.values()), [])


def reward_value_or_raise(value: Any, where: str) -> RewardValue:
    """Check a reward function's return value (float-like or a dict of floats)."""
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, bool | int | float):
        return float(value)
    raise TypeError(f"{where} returned {type(value).__name__}; a reward must be a float or a dict of floats")
