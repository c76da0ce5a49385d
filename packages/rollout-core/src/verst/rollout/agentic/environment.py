"""The `Environment` protocol: the one seam for everything interactive.

An environment owns the state of **one episode**. The rollout builds a fresh one per episode
(from `[rollout.env]`, through an `EnvironmentFactory`), and drives it:

    obs = await env.reset(sample)          # the first observation (None = the sample's prompt)
    while True:
        turn = <one model turn, generated from the exact tokens so far>
        result = await env.step(turn)      # StepResult(observation, reward, done, info)
        if result.done: break
        <result.observation is tokenized once and appended, loss mask 0>
    await env.close()                      # always, in a `finally`

Observations are text (tokenized exactly once, when they arrive), exact token ids, or chat
messages (rendered with the tokenizer's chat template as a suffix of the conversation). Model
turns reach the environment as the exact ids the engine generated plus their decoded text; the
trajectory is never re-tokenised. See `docs/agentic.md`.

Tool calls inside a step can be traced with `verst.rollout.agentic.tool_span` (the built-in
tool environment does), which emits the `tool_start` / `tool_end` lifecycle events.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from verst.rollout.sample import Sample


class TerminationReason(enum.StrEnum):
    """Why an episode ended (`sample.metadata["termination"]`, counted per rollout)."""

    STOP = "stop"
    """The model finished (e.g. answered without calling a tool)."""
    MAX_TURNS = "max_turns"
    """`rollout.env.max_turns` model turns were generated."""
    MAX_TOKENS = "max_tokens"
    """The trajectory's token budget (`rollout.env.max_tokens` / `rollout.max_context_len`) ran out."""
    ENV_DONE = "env_done"
    """The environment said `done` (e.g. the game was won or lost)."""
    TOOL_ERROR = "tool_error"
    """Too many tool errors in a row (`max_tool_errors` of the tool environment)."""
    TIMEOUT = "timeout"
    """An environment step or the whole episode exceeded its timeout."""
    ABORTED = "aborted"
    """The rollout aborted the episode (target reached, weight update); see `on_abort`."""


class EnvCallError(RuntimeError):
    """An environment call (`env.reset`, `env.step`, or building the environment) raised: the
    message names the call and the environment class, then the original error (`__cause__`)."""

    def __init__(self, call: str, env: str, cause: BaseException) -> None:
        super().__init__(f"{call} of environment {env} raised {type(cause).__name__}: {cause}")
        self.call = call
        """`env.reset`, `env.step` or `env factory`."""
        self.cause = cause
        """What the environment raised."""


@dataclass(frozen=True, slots=True)
class Observation:
    """What an environment feeds to the model. Exactly one of the three forms is used:
    `token_ids` if set, else `messages` if non-empty, else `text`."""

    text: str = ""
    """Plain text, tokenized once (no special tokens added) and appended as is."""
    token_ids: tuple[int, ...] | None = None
    """Exact token ids to append (the environment tokenized them itself)."""
    messages: tuple[dict[str, Any], ...] = ()
    """Chat messages (e.g. `{"role": "tool", "content": ...}`), rendered with the tokenizer's
    chat template as the continuation of the conversation, generation prompt included."""
    tools: tuple[dict[str, Any], ...] = ()
    """JSON schemas of the tools, passed as the chat template's `tools=` when a first
    observation (from `reset`) is rendered from messages."""
    images: tuple[Any, ...] = ()
    """Images (`PIL.Image`, path or base64) for the `<image>` placeholders of the observation, in
    order; a vision-language model sees them, and their tokens are masked out of the loss like
    the rest of the observation (docs/vlm.md)."""

    @property
    def is_empty(self) -> bool:
        return self.token_ids is None and not self.messages and not self.text


ObservationLike = Observation | str | None
"""What `reset`/`step` may return: an `Observation`, plain text, or None (nothing to append;
from `reset`: use the sample's prompt as the first observation)."""


@dataclass(frozen=True, slots=True)
class ModelTurn:
    """One model turn as the engine produced it."""

    turn_index: int
    """0 for the first model turn of the episode."""
    token_ids: tuple[int, ...]
    """The exact ids the engine generated in this turn (stop token included)."""
    text: str
    """Their decoded text (what tool-call parsers read)."""
    finish_reason: str
    """The engine's finish reason: stop or length."""


@dataclass(slots=True)
class StepResult:
    """What `Environment.step` returns."""

    observation: ObservationLike = None
    """What the model sees next (ignored when `done`)."""
    reward: float | None = None
    """This step's reward (kept per turn in `sample.metadata["turn_rewards"]`)."""
    done: bool = False
    """The episode is over."""
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form data, merged into `sample.metadata["env_info"]`."""
    termination: TerminationReason | str | None = None
    """With `done`: why (default `env_done`); e.g. the tool env ends with `stop`."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Counters summed over the episode into `sample.metadata["env_metrics"]` and reported per
    rollout as `rollout/env/<name>` (sums), e.g. `tool_calls`, `tool_errors`."""


@runtime_checkable
class Environment(Protocol):
    """One episode of an interactive task. Built fresh per episode; not shared."""

    async def reset(self, sample: Sample) -> ObservationLike:
        """Start the episode for `sample` (its prompt, label and metadata); return the first
        observation, or None to use the sample's prompt (tokenized the usual way)."""
        ...

    async def step(self, turn: ModelTurn) -> StepResult:
        """React to one model turn."""
        ...

    async def close(self) -> None:
        """Release the episode's resources. Called exactly once, in a `finally`."""
        ...


EnvironmentFactory = Callable[[], Environment]
"""Builds one `Environment` per episode. Made once per run from `[rollout.env]`: for an
environment class `E` it is `lambda: E(config)` (or `E()` without a `Config`); a class with a
classmethod `factory(config, setup: EnvSetup) -> EnvironmentFactory` makes its own (to share
expensive resources across episodes). A factory with a `close()` method (sync or async) is
closed when the strategy closes."""


@dataclass(frozen=True, slots=True)
class EnvSetup:
    """What `E.factory(config, setup)` may use to build its episodes."""

    tokenizer: Any = None
    """The run's Hugging Face tokenizer."""
    seed: int | None = None
    """`rollout.seed`."""
