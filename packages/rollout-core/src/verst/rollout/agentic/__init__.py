"""Agentic (multi-turn) rollouts: environments, tools, and one-sample-per-episode trajectories.

- `Environment` (`reset` / `step` / `close`, one instance per episode) is the seam;
  `StepResult`, `Observation`, `ModelTurn`, `TerminationReason` are what crosses it.
- `append_turn` is the only way turns are added to a `Sample` (`trajectory` module).
- `EnvConfig` is `[rollout.env]`; `build_env_factory` resolves it (built-ins: `BUILTIN_ENVS`).
- `tool_span` traces a tool call (`tool_start` / `tool_end` events).

See `docs/agentic.md`.
"""

from verst.rollout.agentic.config import EnvConfig
from verst.rollout.agentic.environment import (
    Environment,
    EnvironmentFactory,
    EnvSetup,
    ModelTurn,
    Observation,
    ObservationLike,
    StepResult,
    TerminationReason,
)
from verst.rollout.agentic.tracing import ToolSpan, tool_span
from verst.rollout.agentic.trajectory import (
    MASKED_LOGPROB,
    append_turn,
    mask_turns_before,
    model_token_positions,
    segments_of,
    trajectory_problems,
)

__all__ = [
    "MASKED_LOGPROB",
    "EnvConfig",
    "EnvSetup",
    "Environment",
    "EnvironmentFactory",
    "ModelTurn",
    "Observation",
    "ObservationLike",
    "StepResult",
    "TerminationReason",
    "ToolSpan",
    "append_turn",
    "mask_turns_before",
    "model_token_positions",
    "segments_of",
    "tool_span",
    "trajectory_problems",
]
