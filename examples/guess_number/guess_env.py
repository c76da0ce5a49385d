"""Guess-the-number: a truly multi-turn environment that answers every guess with feedback.

The sample's label is the secret (an integer in [low, high]). Each model turn is a guess (the
first integer in its text); the environment replies ` higher:` or ` lower:` (loss mask 0) and
the episode goes on, until the guess is right (reward 1, termination `env_done`) or
`rollout.env.max_turns` guesses were wrong (reward 0 from the last step, termination
`max_turns`). A turn without a number gets ` ?:` and counts as a wrong guess.

`[rollout.env] type = "guess_env:GuessNumber"` (the config's folder is on `sys.path`).
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field

from verst.rollout.agentic import ModelTurn, StepResult
from verst.rollout.sample import Sample

NUMBER = re.compile(r"\d+")


class GuessConfig(BaseModel):
    """`[rollout.env.options]` of the guessing game."""

    model_config = ConfigDict(extra="forbid")

    low: int = Field(1, description="Smallest possible secret.")
    high: int = Field(16, description="Largest possible secret.")


class GuessNumber:
    """One game (see the module docstring)."""

    Config = GuessConfig

    def __init__(self, config: GuessConfig) -> None:
        self.config = config
        self.secret = 0
        self.guesses: list[int] = []

    async def reset(self, sample: Sample) -> None:
        self.secret = int(sample.label)
        if not self.config.low <= self.secret <= self.config.high:
            raise ValueError(f"secret {self.secret} outside [{self.config.low}, {self.config.high}]")
        return None  # the prompt as the data gives it

    async def step(self, turn: ModelTurn) -> StepResult:
        match = NUMBER.search(turn.text)
        if match is None:
            return StepResult(observation=" ?:", reward=0.0, metrics={"invalid_guesses": 1})
        guess = int(match.group())
        repeated = guess in self.guesses
        self.guesses.append(guess)
        metrics = {"repeated_guesses": float(repeated)}
        if guess == self.secret:
            return StepResult(done=True, reward=1.0, info={"guesses": list(self.guesses)}, metrics=metrics)
        hint = " higher:" if guess < self.secret else " lower:"
        return StepResult(observation=hint, reward=0.0, info={"guesses": list(self.guesses)}, metrics=metrics)

    async def close(self) -> None:
        pass
