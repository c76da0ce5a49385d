"""An OpenEnv environment (PyPI `openenv`) mapped onto verst's `Environment` protocol.

Two ways to reach it:

    [rollout.env]
    type = "openenv"
    [rollout.env.options]
    base_url = "http://127.0.0.1:8000"     # a running OpenEnv server: one WebSocket session per
                                           # episode through the package's GenericEnvClient
    # or, in process (no server):
    # env_class = "my_env.server.env:MyEnvironment"
    # action_class = "my_env.models:MyAction"
    action_field = "message"               # the model's turn text goes into this action field
    observation_field = "echoed_message"   # this observation field is what the model sees next

Per episode: `reset` (seeded from `rollout.seed` and the sample, plus `reset_kwargs`) gives the
first observation, shown after the sample's prompt; every model turn becomes one action
(`{action_field: text, **action_defaults}`, or `action_fn(text) -> dict`), `step` returns the
observation, `reward` and `done`; the rendered observation (`observation_field`, or
`observation_fn(obs) -> str`, or the observation's JSON) is the next input. `done` ends the
episode (termination `env_done`), the last step's reward is its reward (`rollout.env.reward`
chooses final or sum). A server error, a WebSocket failure or timeout (`message_timeout_s`), an
exception of an in-process environment, or an observation without the configured field is an
`EnvFailure`. Needs the `openenv` extra (`uv sync --extra openenv`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from verst.rollout.agentic.environment import EnvironmentFactory, EnvSetup, ModelTurn, Observation, StepResult
from verst.rollout.engines.common.errors import require
from verst.rollout.importing import import_object
from verst.rollout.integrations._common import EnvFailure
from verst.rollout.rewards.rules import strip_trailing_stop
from verst.rollout.sample import Sample

EXTRA = "openenv"


class OpenEnvOptions(BaseModel):
    """`rollout.env.options` of `type = "openenv"`."""

    model_config = ConfigDict(extra="forbid")

    base_url: str | None = Field(None, description="URL of a running OpenEnv server (WebSocket sessions).")
    env_class: str | None = Field(
        None, description="Import path of an openenv Environment class (in process)."
    )
    env_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Constructor arguments of env_class."
    )
    action_class: str | None = Field(None, description="Import path of its Action class (in process).")
    action_field: str = Field("message", description="Action field that receives the model's turn text.")
    action_defaults: dict[str, Any] = Field(default_factory=dict, description="Other fields of every action.")
    action_fn: str | None = Field(
        None, description="Import path of fn(text) -> action dict (instead of action_field)."
    )
    observation_field: str | None = Field(
        None, description="Observation field shown to the model (None = its JSON)."
    )
    observation_fn: str | None = Field(None, description="Import path of fn(observation dict) -> str.")
    observation_template: str = Field(
        "{observation}\n", description="How a rendered observation is appended."
    )
    reset_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments of reset."
    )
    show_reset_observation: bool = Field(True, description="Append the reset observation after the prompt.")
    message_timeout_s: float = Field(60.0, gt=0, description="Client: timeout of one reset/step message.")
    connect_timeout_s: float = Field(10.0, gt=0, description="Client: timeout of opening the WebSocket.")

    @model_validator(mode="after")
    def _one_target(self) -> OpenEnvOptions:
        if (self.base_url is None) == (self.env_class is None):
            raise ValueError("set exactly one of base_url (a server) and env_class (in process)")
        if self.env_class is not None and self.action_class is None:
            raise ValueError("env_class needs action_class (the Action model its step takes)")
        return self


class _Session:
    """reset/step/close of one episode, as (observation dict, reward, done) — server or in process."""

    def __init__(self, options: OpenEnvOptions, env_cls: Any, action_cls: Any) -> None:
        self.options = options
        self.action_cls = action_cls
        if options.base_url is not None:
            from openenv.core.generic_client import GenericEnvClient

            self.client: Any = GenericEnvClient(
                base_url=options.base_url,
                connect_timeout_s=options.connect_timeout_s,
                message_timeout_s=options.message_timeout_s,
            )
            self.env = None
        else:
            self.client = None
            self.env = env_cls(**options.env_kwargs)

    async def reset(self, **kwargs: Any) -> tuple[dict[str, Any], float | None, bool]:
        if self.client is not None:
            r = await self.client.reset(**kwargs)
            return r.observation, r.reward, r.done
        return self._unpack(await self._call(self.env.reset, "reset_async", **kwargs))

    async def step(self, action: dict[str, Any]) -> tuple[dict[str, Any], float | None, bool]:
        if self.client is not None:
            r = await self.client.step(action)
            return r.observation, r.reward, r.done
        typed = self.action_cls(**action)
        return self._unpack(await self._call(self.env.step, "step_async", typed))

    async def _call(self, sync_fn: Any, async_name: str, *args: Any, **kwargs: Any) -> Any:
        from openenv.core.env_server.interfaces import Environment as Base

        async_fn = getattr(self.env, async_name, None)
        if async_fn is not None and getattr(type(self.env), async_name) is not getattr(
            Base, async_name, None
        ):
            return await async_fn(*args, **kwargs)
        return await asyncio.to_thread(sync_fn, *args, **kwargs)

    @staticmethod
    def _unpack(obs: Any) -> tuple[dict[str, Any], float | None, bool]:
        from openenv.core.env_server.serialization import serialize_observation

        payload = serialize_observation(obs)
        return payload.get("observation", {}), payload.get("reward"), bool(payload.get("done", False))

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        elif self.env is not None:
            await asyncio.to_thread(self.env.close)


class OpenEnvEnvironment:
    """One OpenEnv episode (see the module docstring)."""

    Config = OpenEnvOptions

    def __init__(self, options: OpenEnvOptions, setup: EnvSetup, parts: dict[str, Any]) -> None:
        self.options = options
        self.setup = setup
        self.parts = parts
        self.session: _Session | None = None
        self.turns = 0

    @classmethod
    def factory(cls, options: OpenEnvOptions, setup: EnvSetup) -> EnvironmentFactory:
        """Resolve the classes and functions once; each episode opens its own session."""
        require("openenv", extra=EXTRA, feature="the OpenEnv environment adapter")
        parts = {
            key: import_object(getattr(options, key), what=f"rollout.env.options.{key}")
            for key in ("env_class", "action_class", "action_fn", "observation_fn")
            if getattr(options, key) is not None
        }
        return lambda: cls(options, setup, parts)

    async def _guard(self, what: str, coro: Any) -> Any:
        try:
            return await coro
        except EnvFailure:
            raise
        except TimeoutError as exc:
            raise EnvFailure("openenv", "timeout", f"{what} timed out: {exc}") from exc
        except (OSError, ConnectionError) as exc:
            raise EnvFailure("openenv", "http_error", f"{what}: {type(exc).__name__}: {exc}") from exc
        except Exception as exc:
            kind = (
                "http_error"
                if "Server error" in str(exc) or "websocket" in type(exc).__module__
                else "exception"
            )
            raise EnvFailure("openenv", kind, f"{what}: {type(exc).__name__}: {exc}") from exc

    def _render(self, obs: Any) -> str:
        if not isinstance(obs, dict):
            raise EnvFailure(
                "openenv", "malformed", f"the observation is a {type(obs).__name__}, not an object"
            )
        fn = self.parts.get("observation_fn")
        if fn is not None:
            text = fn(obs)
        elif self.options.observation_field is not None:
            if self.options.observation_field not in obs:
                raise EnvFailure(
                    "openenv",
                    "malformed",
                    f"the observation has no field {self.options.observation_field!r} (it has {sorted(obs)})",
                )
            text = obs[self.options.observation_field]
        else:
            text = json.dumps({k: v for k, v in obs.items() if k != "metadata"}, sort_keys=True, default=str)
        return self.options.observation_template.format(observation=text)

    async def reset(self, sample: Sample) -> Observation:
        self.session = _Session(self.options, self.parts.get("env_class"), self.parts.get("action_class"))
        kwargs = dict(self.options.reset_kwargs)
        if self.setup.seed is not None:
            kwargs.setdefault("seed", self.setup.seed + (sample.group_index or 0))
        obs, _, _ = await self._guard("reset", self.session.reset(**kwargs))
        prompt = sample.prompt if isinstance(sample.prompt, str) else ""
        if isinstance(sample.prompt, list):
            return Observation(messages=tuple(sample.prompt))
        return Observation(text=prompt + (self._render(obs) if self.options.show_reset_observation else ""))

    async def step(self, turn: ModelTurn) -> StepResult:
        assert self.session is not None
        text = strip_trailing_stop(turn.text)
        fn = self.parts.get("action_fn")
        action = (
            dict(fn(text))
            if fn is not None
            else {**self.options.action_defaults, self.options.action_field: text}
        )
        obs, reward, done = await self._guard("step", self.session.step(action))
        if reward is not None and not isinstance(reward, (int, float)):
            raise EnvFailure("openenv", "malformed", f"the step's reward is {reward!r}")
        self.turns += 1
        reward = None if reward is None else float(reward)
        if done:
            return StepResult(reward=reward, done=True, info={"openenv_steps": self.turns})
        return StepResult(observation=self._render(obs), reward=reward)

    async def close(self) -> None:
        if self.session is not None:
            session, self.session = self.session, None
            with contextlib.suppress(Exception):  # closing a broken session must not hide the outcome
                await session.close()
