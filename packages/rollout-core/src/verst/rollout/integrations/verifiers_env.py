"""A verifiers (`vf.Environment`, verifiers 0.1.x) environment run by verst's episode loop.

    [rollout.env]
    type = "verifiers"
    max_turns = 4
    [rollout.env.options]
    env_id = "my-vf-env"            # what `vf.load_environment(env_id, **env_args)` loads
    env_args = { difficulty = 2 }

    [rollout.data]                  # the environment's own dataset as the prompts
    source = "verifiers"
    [rollout.data.options]
    env_id = "my-vf-env"

verst generates every model turn (exact ids, loss mask 1); the verifiers environment does the
rest through its own hooks, in the order its `MultiTurnEnv.rollout` calls them: `init_state` +
`setup_state` at reset (the prompt messages and `oai_tools` become the first observation, rendered
by the chat template with `tools=`), then per turn the assistant message (tool calls read from the
text with the hermes/qwen25 `<tool_call>` format) is added to `state["trajectory"]`, the
`@vf.stop` conditions are checked (`is_completed`), and `env_response` supplies the next messages
(tool results for a `ToolEnv`). When a stop condition fires, the rubric scores the rollout
(`rubric.score_rollout`); its reward is the episode's reward, its metrics go to `env_info`, and
the stop condition's name is `env_info["stop_condition"]`. `vf.Error`s are recorded on the state
as verifiers does (stop condition `has_error`, reward from the rubric); any other exception is an
`EnvFailure`. Needs the `verifiers` extra (`uv sync --extra verifiers`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from verst.rollout.agentic.environment import EnvironmentFactory, EnvSetup, ModelTurn, Observation, StepResult
from verst.rollout.engines.common.errors import require
from verst.rollout.errors import ConfigError, MissingOptionalDependency, Problem
from verst.rollout.integrations._common import EnvFailure, LoadedSource, assistant_message
from verst.rollout.sample import Sample, Status

EXTRA = "verifiers"


def load_vf_env(env_id: str, env_args: dict[str, Any], key: str = "rollout.env.options") -> Any:
    """`vf.load_environment(env_id, **env_args)` (imports verifiers, or names the install command);
    an environment verst cannot run (not a `vf.MultiTurnEnv`, group-level reward functions) is a
    `ConfigError` naming `key`."""
    vf = require("verifiers", extra=EXTRA, feature="the verifiers environment adapter")
    env = vf.load_environment(env_id, **env_args)
    problems = vf_env_problems(vf, env, env_id, key)
    if problems:
        raise ConfigError(problems)
    return env


def vf_env_problems(vf: Any, env: Any, env_id: str, key: str) -> list[Problem]:
    """What keeps verst from running the loaded verifiers environment `env`."""
    if not isinstance(env, vf.MultiTurnEnv):
        return [
            Problem(
                f"{key}.env_id",
                f"verifiers environment {env_id!r} is a {type(env).__name__}; verst runs vf.MultiTurnEnv "
                "subclasses (SingleTurnEnv, MultiTurnEnv, ToolEnv, StatefulToolEnv), whose turns it can generate",
                "use a multi-turn verifiers environment",
            )
        ]
    rubrics = list(getattr(env.rubric, "rubrics", [env.rubric]))
    group = [f.__name__ for r in rubrics for f in r.funcs if r._is_group_func(f)]
    if group:
        return [
            Problem(
                f"{key}.env_id",
                f"verifiers environment {env_id!r} has group-level reward functions {group}; verst scores "
                "each episode with rubric.score_rollout",
                "use per-rollout reward functions (or a verst group reward: rollout.env.reward = "
                "'reward_fn' with rollout.reward.group = true)",
            )
        ]
    return []


class VerifiersOptions(BaseModel):
    """`rollout.env.options` of `type = "verifiers"`."""

    model_config = ConfigDict(extra="forbid")

    env_id: str = Field(description="The verifiers environment id (a module with load_environment).")
    env_args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of load_environment."
    )
    tool_call_parser: Literal["hermes", "qwen25"] | None = Field(
        "hermes", description="How tool calls are read from the model's text (None: never)."
    )


class VerifiersEnvironment:
    """One episode of a verifiers environment (see the module docstring)."""

    Config = VerifiersOptions

    def __init__(self, vf_env: Any, options: VerifiersOptions) -> None:
        self.vf_env = vf_env
        self.options = options
        self.state: Any = None
        self._prompt: Any = None

    @staticmethod
    def problems(options: VerifiersOptions, key: str) -> list[Problem]:
        """Checks at validation, before any model loads: the environment loads, and verst can run
        it (a group-level rubric is refused here, not after the model has loaded)."""
        try:
            load_vf_env(options.env_id, options.env_args, key)
        except ConfigError as exc:
            return list(exc.problems)
        except MissingOptionalDependency as exc:
            return [Problem("rollout.env.type", str(exc), "install the extra it names")]
        except Exception as exc:
            return [
                Problem(
                    f"{key}.env_id",
                    f"vf.load_environment({options.env_id!r}) raised {type(exc).__name__}: {exc}",
                    "check env_id (a module with load_environment) and env_args",
                )
            ]
        return []

    @classmethod
    def factory(cls, options: VerifiersOptions, setup: EnvSetup) -> EnvironmentFactory:
        """Load the verifiers environment once; each episode gets its own state."""
        vf_env = load_vf_env(options.env_id, options.env_args)
        return lambda: cls(vf_env, options)

    async def _call(self, what: str, coro: Any) -> Any:
        import verifiers as vf

        try:
            return await coro
        except vf.Error as exc:  # verifiers' own error channel: recorded on the state, stops the rollout
            self.state["error"] = exc
            return None
        except Exception as exc:
            raise EnvFailure("verifiers", "exception", f"{what}: {type(exc).__name__}: {exc}") from exc

    async def reset(self, sample: Sample) -> Observation:
        env = self.vf_env
        meta = sample.metadata.get("verifiers") or {}
        prompt = sample.prompt
        if env.message_type == "chat" and isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        row: dict[str, Any] = {
            "prompt": prompt,
            "example_id": meta.get("example_id", sample.group_index or 0),
            "task": meta.get("task", env.env_id or "default"),
            "answer": "" if sample.label is None else sample.label,
        }
        if "info" in meta:
            row["info"] = meta["info"]
        try:
            self.state = await env.init_state(row, client=None, model="verst", sampling_args={})
        except Exception as exc:
            raise EnvFailure("verifiers", "exception", f"init_state: {type(exc).__name__}: {exc}") from exc
        state = await self._call("setup_state", env.setup_state(self.state))
        if state is not None:
            self.state = state
        self._prompt = self.state["prompt"]
        if isinstance(self._prompt, str):
            return Observation(text=self._prompt)
        return Observation(messages=tuple(self._prompt), tools=tuple(self.state["oai_tools"] or ()))

    async def step(self, turn: ModelTurn) -> StepResult:
        from verifiers.utils.message_utils import concat_messages

        env, state = self.vf_env, self.state
        if isinstance(self._prompt, str):
            completion: Any = turn.text
        else:
            tools = state["oai_tools"] or None
            completion = [assistant_message(turn.text, tools, self.options.tool_call_parser is not None)]
        step = {
            "prompt": self._prompt,
            "completion": completion,
            "response": None,
            "tokens": None,
            "reward": None,
            "advantage": None,
            "is_truncated": turn.finish_reason == "length",
            "trajectory_id": state["trajectory_id"],
            "extras": {"verst_turn": turn.turn_index},
        }
        await self._call("add_trajectory_step", env.add_trajectory_step(state, step))
        if state.get("error") is None and not await env.is_completed(state):
            messages = concat_messages([self._prompt, completion])
            reply = await self._call("env_response", env.env_response(messages, state))
            if state.get("error") is None and state.get("final_env_response") is None:
                if reply is None or not isinstance(reply, (list, str)):
                    raise EnvFailure(
                        "verifiers", "malformed", f"env_response returned {type(reply).__name__}"
                    )
                if not reply:  # nothing to feed back: the model would generate after its own EOS
                    raise EnvFailure(
                        "verifiers", "malformed", f"env_response returned no messages ({reply!r})"
                    )
                self._prompt = concat_messages([messages, reply])
                if isinstance(reply, str):
                    return StepResult(observation=reply)
                return StepResult(observation=Observation(messages=tuple(reply)))
        return await self._finish()

    async def _finish(self) -> StepResult:
        env, state = self.vf_env, self.state
        if not state.get("is_completed"):
            await env.is_completed(state)  # records stop_condition (e.g. has_error, has_final_env_response)
        await self._call("render_completion", env.render_completion(state))
        try:
            await env.rubric.score_rollout(state)
        except Exception as exc:
            raise EnvFailure("verifiers", "exception", f"rubric: {type(exc).__name__}: {exc}") from exc
        reward = state.get("reward")
        if not isinstance(reward, (int, float)):
            raise EnvFailure("verifiers", "malformed", f"the rubric gave reward {reward!r}")
        info: dict[str, Any] = {"stop_condition": state.get("stop_condition")}
        if state.get("metrics"):
            info["metrics"] = dict(state["metrics"])
        if state.get("error") is not None:
            info["error"] = f"{type(state['error']).__name__}: {state['error']}"
        return StepResult(reward=float(reward), done=True, info=info, termination="env_done")

    async def close(self) -> None:
        if self.state is not None:
            cleanup = getattr(self.vf_env, "_cleanup", None)
            if cleanup is not None and not self.state.get("is_completed"):
                await cleanup(self.state)
            self.state = None


class VerifiersSource(LoadedSource):
    """The environment's dataset (`get_dataset` / `get_eval_dataset`) as verst prompts."""

    class Config(BaseModel):
        """`rollout.data.options` of `source = "verifiers"`."""

        model_config = ConfigDict(extra="forbid")

        env_id: str = Field(description="The verifiers environment id (as in rollout.env.options).")
        env_args: dict[str, Any] = Field(
            default_factory=dict, description="Keyword arguments of load_environment."
        )
        split: Literal["train", "eval"] = Field(
            "train", description="get_dataset (train) or get_eval_dataset (eval)."
        )
        num_examples: int = Field(-1, description="Rows to take (-1 = all).")
        shuffle: bool = Field(True, description="Shuffle every epoch (train).")
        seed: int = Field(0, description="Seed of the shuffle.")

    options: Config

    def _rows(self) -> list[Sample]:
        options = self.options
        env = load_vf_env(options.env_id, options.env_args)
        ds = (
            env.get_dataset(options.num_examples)
            if options.split == "train"
            else env.get_eval_dataset(options.num_examples)
        )
        samples = []
        for row in ds:
            meta = {"example_id": row.get("example_id"), "task": row.get("task")}
            if row.get("info") is not None:
                meta["info"] = row["info"]
            samples.append(
                Sample(
                    prompt=row["prompt"],
                    label=row.get("answer"),
                    metadata={"verifiers": meta},
                    status=Status.PENDING,
                )
            )
        return samples

    def _shuffles(self) -> bool:
        """Only the train split is shuffled."""
        return self.options.shuffle and self.options.split == "train"
