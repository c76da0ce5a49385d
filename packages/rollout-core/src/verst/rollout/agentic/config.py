"""`[rollout.env]`: the environment of agentic (multi-turn) rollouts.

    [rollout.env]
    type = "tools"                  # a built-in environment, or "pkg.module:Class"
    max_turns = 4
    [rollout.env.options]           # the environment's own typed options (its `Config`)
    tools = ["examples.tool_math.tools:multiply"]

`options` is validated against the selected environment's nested `Config` model (its keys are
reported as `rollout.env.options.<key>`); everything else here is the rollout loop's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

PER_TURN_REWARDS = ("per_turn", "per_turn_reward_fn")
"""`rollout.env.reward` values that put rewards on turn ends (for estimators with `per_turn`)."""


class EnvConfig(BaseModel):
    """How agentic episodes run (the rollout loop's settings, plus the environment's options)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    type: str = Field(
        "tools",
        description="A built-in environment (tools) or an import path 'pkg.module:Class' of an Environment.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="The environment's own options, validated by its `Config`."
    )
    max_turns: int = Field(
        8, ge=1, description="Model turns per episode at most (then termination max_turns)."
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="Token budget of a whole trajectory, prompt included (None = rollout.max_context_len, "
        "else unlimited); rollout.max_response_len bounds each model turn.",
    )
    step_timeout_s: float | None = Field(
        60.0, gt=0, description="Timeout of one environment reset/step (then termination timeout)."
    )
    episode_timeout_s: float | None = Field(
        None, gt=0, description="Timeout of a whole episode (then termination timeout)."
    )
    max_episodes_in_flight: int | None = Field(
        None,
        ge=1,
        description="Episodes running at once at most (None = no limit beyond the groups in flight).",
    )
    on_abort: Literal["resume", "restart"] = Field(
        "restart",
        description="An episode aborted mid-way: 'resume' keeps its turns and live environment and continues "
        "it when resubmitted (needs partial_rollout), 'restart' starts it again from its prompt.",
    )
    reward: Literal["final", "sum", "reward_fn", "per_turn", "per_turn_reward_fn"] = Field(
        "final",
        description="The episode's reward: the environment's last step reward (final), the sum of its step "
        "rewards (sum), rollout.reward over the whole trajectory (reward_fn), each step's reward on its "
        "turn's last token (per_turn), or rollout.reward (a judge, a rule, ...) scoring each model turn, on "
        "its last token (per_turn_reward_fn). The per-turn ones: for gae and grpo_per_turn only; docs/rewards.md.",
    )
