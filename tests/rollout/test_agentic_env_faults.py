"""Environment classes and faults through the real episode loop (#25 items 3, 12, 13): a class
without a `Config` gets a fresh instance per episode and the run closes cleanly; a raising
environment is named with its call in `RolloutFailedError`; `turn_end` carries every documented
field on the turn that ends the episode and on a turn the token budget cuts."""

from __future__ import annotations

import asyncio
from typing import ClassVar

import pytest
from agentic_testkit import ScriptEngine, context
from pydantic import BaseModel

from verst.rollout.agentic import ModelTurn, StepResult
from verst.rollout.errors import RolloutFailedError
from verst.rollout.lifecycle import EventKind
from verst.rollout.protocols import RolloutRequest
from verst.rollout.strategies.inference import InferenceRollout

TURN_END_FIELDS = {"turn", "duration_s", "queue_s", "gen_s", "env_s", "tokens", "obs_tokens", "status"}


class NoConfigEnv:
    """No `Config`: each episode must get `NoConfigEnv()`. One step, then done."""

    instances: ClassVar[list[NoConfigEnv]] = []

    def __init__(self) -> None:
        self.closed = False
        type(self).instances.append(self)

    async def reset(self, sample):
        return None

    async def step(self, turn: ModelTurn) -> StepResult:
        return StepResult(observation="[bye]", reward=1.0, done=True)

    async def close(self) -> None:
        self.closed = True


class _WithConfig(NoConfigEnv):
    """Has a `Config`: built as `Class(options)` (independent of the no-Config path)."""

    class Config(BaseModel):
        pass

    def __init__(self, options: BaseModel) -> None:
        super().__init__()


class ResetFails(_WithConfig):
    async def reset(self, sample):
        raise ValueError("the sandbox did not start")


class TwoTurns(_WithConfig):
    """Continues once with an observation, then ends."""

    def __init__(self, options: BaseModel) -> None:
        super().__init__(options)
        self.n = 0

    async def step(self, turn: ModelTurn) -> StepResult:
        self.n += 1
        return StepResult(observation="[obs]", reward=0.0, done=self.n >= 2)


def _run(reply: str = "go", **config):
    ctx = context(ScriptEngine(lambda conv, req: reply), prompts=[f"p{i}:" for i in range(6)], **config)
    strategy = InferenceRollout(ctx)

    async def go():
        try:
            return await strategy(RolloutRequest(0))
        finally:
            await strategy.close()

    return go, ctx


def test_an_env_class_without_config_gets_an_instance_per_episode_and_closes_cleanly():
    """Before the fix the factory was the class itself: `AgenticGenerate.close` called the unbound
    `NoConfigEnv.close()` and the run ended with `TypeError: missing ... 'self'`."""
    NoConfigEnv.instances.clear()
    go, _ = _run(batch_size=2, env={"type": f"{__name__}:NoConfigEnv"})
    result = asyncio.run(go())
    assert [s.reward for g in result.groups for s in g] == [1.0, 1.0]
    assert len(NoConfigEnv.instances) == 2 and all(e.closed for e in NoConfigEnv.instances)


def test_rollout_failed_error_names_the_environment_and_the_failing_call():
    env_type = f"{__name__}:ResetFails"
    go, _ = _run(batch_size=1, max_group_retries=0, env={"type": env_type})
    with pytest.raises(RolloutFailedError) as info:
        asyncio.run(go())
    msg = str(info.value)
    assert "env.reset of environment ResetFails raised ValueError: the sandbox did not start" in msg
    assert f"environment: rollout.env.type={env_type!r}" in msg
    assert "SingleTurnGenerate" not in msg


def _turn_ends(ctx) -> list[dict]:
    return [e.detail for e in ctx.sink.events if e.kind is EventKind.TURN_END]


def test_turn_end_of_the_episode_ending_turn_has_every_documented_field():
    env_type = f"{__name__}:TwoTurns"
    go, ctx = _run(batch_size=1, env={"type": env_type})
    asyncio.run(go())
    first, last = _turn_ends(ctx)
    assert set(first) >= TURN_END_FIELDS and first["obs_tokens"] == len("[obs]")
    assert set(last) >= TURN_END_FIELDS, sorted(TURN_END_FIELDS - set(last))
    assert last["status"] == "env_done" and last["obs_tokens"] == 0 and last["env_s"] >= 0


def test_turn_end_of_a_turn_the_token_budget_cuts_has_every_documented_field():
    env_type = f"{__name__}:TwoTurns"
    # prompt "p0:" is 3 byte tokens; a budget of 8 leaves 5 for a 40-character reply
    go, ctx = _run(reply="x" * 40, batch_size=1, env={"type": env_type, "max_tokens": 8})
    result = asyncio.run(go())
    assert result.groups[0][0].metadata["termination"] == "max_tokens"
    (cut,) = _turn_ends(ctx)
    assert cut["status"] == "max_tokens" and cut["tokens"] == 5
    assert set(cut) >= TURN_END_FIELDS, sorted(TURN_END_FIELDS - set(cut))
    assert cut["env_s"] == 0.0 and cut["obs_tokens"] == 0
