"""verst rollout core: samples, the strategy protocol, the default class-based rollout.

Only light, dependency-free names are re-exported here; engines, rewards and strategies are
imported from their own modules (`verst.rollout.engines`, `verst.rollout.rewards`, ...).
"""

from verst.rollout.engine import (
    EngineError,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    InferenceEngine,
    SamplingParams,
)
from verst.rollout.errors import ConfigError, DataError, MissingOptionalDependency, Problem
from verst.rollout.lifecycle import EventKind, JsonlSink, LifecycleEvent, LifecycleSink, ListSink, NoopSink
from verst.rollout.protocols import (
    Capability,
    DataSource,
    GenerateFn,
    GenerateInput,
    GenerateState,
    GroupRewardFn,
    RewardFn,
    RolloutContext,
    RolloutRequest,
    RolloutResult,
    RolloutStrategy,
)
from verst.rollout.sample import Sample, SampleInvariantError, Status

__all__ = [
    "Capability",
    "ConfigError",
    "DataError",
    "DataSource",
    "EngineError",
    "EventKind",
    "FinishReason",
    "GenerateFn",
    "GenerateInput",
    "GenerateOutput",
    "GenerateRequest",
    "GenerateState",
    "GroupRewardFn",
    "InferenceEngine",
    "JsonlSink",
    "LifecycleEvent",
    "LifecycleSink",
    "ListSink",
    "MissingOptionalDependency",
    "NoopSink",
    "Problem",
    "RewardFn",
    "RolloutContext",
    "RolloutRequest",
    "RolloutResult",
    "RolloutStrategy",
    "Sample",
    "SampleInvariantError",
    "SamplingParams",
    "Status",
]
