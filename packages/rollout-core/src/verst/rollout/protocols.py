"""The seams of the rollout layer: strategies, generate functions, data sources, rewards.

A `RolloutStrategy` is built once from a `RolloutContext` and called once per rollout with a
`RolloutRequest`; it returns a `RolloutResult`. It only sees what the context carries (config,
data source, engine, tokenizer, reward functions, lifecycle sink, effective environment), never
the trainer, so the same strategy runs in the driver process or inside a Ray actor.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from pydantic import BaseModel

from verst.rollout.engine import InferenceEngine, SamplingParams
from verst.rollout.lifecycle import LifecycleSink, NoopSink
from verst.rollout.sample import Sample

if TYPE_CHECKING:
    from verst.rollout.config import RolloutConfig

RewardValue = float | dict[str, float]


class Capability(enum.StrEnum):
    """A feature a strategy may or may not support; validation compares them with the config."""

    FULLY_ASYNC = "fully_async"
    PARTIAL_ROLLOUT = "partial_rollout"
    MASK_OFFPOLICY_IN_PARTIAL_ROLLOUT = "mask_offpolicy_in_partial_rollout"
    DYNAMIC_FILTER = "dynamic_filter"
    OVER_SAMPLING = "over_sampling"
    GROUP_REWARD = "group_reward"
    CUSTOM_GENERATE_FUNCTION = "custom_generate_function"
    PER_SAMPLE_GENERATE_OVERRIDE = "per_sample_generate_override"
    EVAL = "eval"
    LIFECYCLE_EVENTS = "lifecycle_events"
    OPD_SAMPLED_TOKEN = "opd_sampled_token"
    OPD_TOP_K = "opd_top_k"
    RESUMABLE_STATE = "resumable_state"
    MULTI_TURN_ENV = "multi_turn_env"


@runtime_checkable
class DataSource(Protocol):
    """Hands out groups of prompt samples and takes unfinished ones back (the slime/miles ABI)."""

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        """`num_groups` groups, each `n_samples_per_prompt` PENDING clones of one prompt.

        Samples handed back with `add_samples` are served first.
        """
        ...

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Take back groups that were not used (aborted or unfinished); none are lost."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: epoch, offset, RNG, returned samples."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict`."""
        ...


@runtime_checkable
class RewardFn(Protocol):
    """Scores one finished sample."""

    async def __call__(self, sample: Sample) -> RewardValue: ...


@runtime_checkable
class GroupRewardFn(Protocol):
    """Scores a whole group at once (e.g. pairwise or rank-based rewards)."""

    async def __call__(self, samples: list[Sample]) -> list[RewardValue]: ...


@dataclass
class RolloutContext:
    """Everything a strategy is built from. Passed once, at construction."""

    config: RolloutConfig
    """The rollout section of the run config."""
    data_source: DataSource
    """Training prompts."""
    engine: InferenceEngine
    """The engine (or a load-balancing group of engines) requests go to."""
    tokenizer: Any = None
    """A Hugging Face tokenizer (prompts → ids, ids → text)."""
    reward_fn: RewardFn | None = None
    """Per-sample reward; None when `group_reward_fn` is used or rewards come from elsewhere."""
    group_reward_fn: GroupRewardFn | None = None
    """Per-group reward, used instead of `reward_fn` when `config.reward.group` is on."""
    sink: LifecycleSink = field(default_factory=NoopSink)
    """Where lifecycle events go."""
    eval_datasets: Mapping[str, list[Sample]] = field(default_factory=dict)
    """Named eval sets: prompt samples (PENDING, one per prompt)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """The effective environment (`resolve_extra_env_vars`); never read `os.environ` instead."""
    vision: Any = None
    """The model's `verst.rollout.multimodal.MultimodalProcessor` (vision-language models; None =
    text only): expands the image tokens of images in environment observations."""
    v1_args: Mapping[str, Any] = field(default_factory=dict)
    """Extra settings for v1 functions' `args` (e.g. `hf_checkpoint`, `sglang_router_ip`,
    `sglang_router_port`); see `verst.rollout.v1_args.build_v1_args`."""


def strategy_options_model(strategy: Any) -> type[BaseModel] | None:
    """The `Options` pydantic model a strategy class declares for `rollout.strategy_options`."""
    model = getattr(strategy, "Options", None) if isinstance(strategy, type) else None
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def strategy_options(strategy: type, config: RolloutConfig) -> Any:
    """The strategy's validated options (an instance of its `Options`) from
    `config.strategy_options`; call it in the strategy's constructor. Validation already
    reported bad options before anything loaded."""
    model = strategy_options_model(strategy)
    if model is None:
        raise TypeError(f"{strategy.__qualname__} declares no `Options` model")
    return model.model_validate(dict(config.strategy_options))


@dataclass(frozen=True, slots=True)
class RolloutRequest:
    """One call of a strategy."""

    rollout_id: int
    """Monotonic rollout counter (the training step for synchronous training)."""
    weight_version: int = 0
    """The policy weight version the trainer has pushed to the engines."""
    evaluation: bool = False
    """Run the eval datasets instead of a training rollout."""


@dataclass
class RolloutResult:
    """What a strategy returns."""

    groups: list[list[Sample]] = field(default_factory=list)
    """Training groups (one per prompt, `n_samples_per_prompt` samples each)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Flat metrics, e.g. `rollout/reward_mean`, `rollout/dropped/zero_std`."""
    eval: dict[str, list[list[Sample]]] = field(default_factory=dict)
    """For evaluation requests: groups per eval dataset name."""


@runtime_checkable
class RolloutStrategy(Protocol):
    """A rollout: built once from a context, called per rollout.

    Implementations: `InferenceRollout` (the default), `FullyAsyncRollout`, and the legacy v1
    strategy in `verst-rollout-legacy`. `capabilities` lists what the strategy supports;
    config validation refuses a requested feature outside it before anything heavy loads.
    """

    capabilities: ClassVar[frozenset[Capability]]

    async def __call__(self, request: RolloutRequest) -> RolloutResult:
        """Produce one rollout (or one evaluation when `request.evaluation`)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The strategy's own resumable state (buffered samples, counters)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict`."""
        ...

    async def close(self) -> None:
        """Stop background work; hand unfinished samples back to the data source."""
        ...


class ContextViews:
    """What a holder of the strategy's `context` reads through it (engine, tokenizer, config,
    sink, eval sets): `GenerateState` and the legacy runtime."""

    context: RolloutContext

    @property
    def engine(self) -> InferenceEngine:
        """The engine (or engine group) requests go to."""
        return self.context.engine

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer."""
        return self.context.tokenizer

    @property
    def config(self) -> RolloutConfig:
        """The rollout section of the run config."""
        return self.context.config

    @property
    def sink(self) -> LifecycleSink:
        """Where lifecycle events go."""
        return self.context.sink

    @property
    def eval_datasets(self) -> Mapping[str, list[Sample]]:
        """Named eval sets (one PENDING prompt sample per prompt)."""
        return self.context.eval_datasets


@dataclass
class GenerateState(ContextViews):
    """Per-rollout state shared by every `generate_and_rm` call of that rollout."""

    context: RolloutContext
    """The strategy's context."""
    rollout_id: int
    """The rollout being generated."""
    weight_version: int
    """The weight version the rollout was requested at."""
    semaphore: asyncio.Semaphore
    """Bounds concurrent engine requests (`rollout.max_concurrency`)."""
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the rollout has what it needs; generate functions stop early."""
    request_prefix: str = ""
    """Prefix of this rollout's engine request ids (`"" = f"r{rollout_id}"`); the strategy aborts
    exactly this rollout's requests with `engine.abort(request_prefix + "-")`."""
    generate_fn: Any = None
    """The strategy's `GenerateFn` (None = `verst.rollout.generate.SingleTurnGenerate`)."""
    generate_fn_cache: dict[str, Any] = field(default_factory=dict)
    """Per-sample generate functions already loaded, by import path (owned by the strategy)."""


@dataclass
class GenerateInput:
    """The single argument of a new-style generate function."""

    state: GenerateState
    """Shared rollout state: engine, tokenizer, semaphore, abort flag."""
    sample: Sample
    """The sample to generate (PENDING, or ABORTED with partial tokens to resume)."""
    sampling_params: SamplingParams
    """This call's own copy of the sampling params."""
    evaluation: bool = False
    """True for eval rollouts."""


@runtime_checkable
class GenerateFn(Protocol):
    """Generates one sample and returns it (or a one-element list).

    A multi-turn episode is still ONE sample (prompt + every turn, built with
    `verst.rollout.agentic.append_turn`); returning several samples for one input is refused
    with `GenerateContractError` (regrouping turns as samples would bias GRPO advantages).
    A function with `acquires_semaphore = True` takes `state.semaphore` per engine request
    itself instead of having `generate_and_rm` hold it for the whole call.
    """

    async def __call__(self, inp: GenerateInput) -> Sample | list[Sample]: ...
