"""`[rollout.env]` → an `EnvironmentFactory` (one environment per episode).

`type` is a built-in name (`BUILTIN_ENVS`, one table entry per environment) or an import path
`pkg.module:Class`. The class's nested `Config` (a pydantic model) validates `options`; a class
without one takes no options. A static `problems(options, key) -> list[Problem]` on the class runs
deeper checks at validation (the verifiers adapter loads its environment and checks its rubric). Problems are reported as `Problem`s with their config keys, so
validation lists them with every other problem before anything loads.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from verst.rollout.agentic.config import EnvConfig
from verst.rollout.agentic.environment import EnvironmentFactory, EnvSetup
from verst.rollout.errors import ConfigError, Problem
from verst.rollout.importing import ImportPathError, import_object

BUILTIN_ENVS: dict[str, str] = {
    "tools": "verst.rollout.agentic.tools:ToolEnvironment",
    # environment ecosystems (docs/environments.md), each importing its package only when selected
    "verifiers": "verst.rollout.integrations.verifiers_env:VerifiersEnvironment",
    "openenv": "verst.rollout.integrations.openenv_env:OpenEnvEnvironment",
    "nemo_gym": "verst.rollout.integrations.nemo_gym_env:NemoGymEnvironment",
}
"""Built-in environment name → import path of its class."""

KEY = "rollout.env"


def resolve_env_class(type_: str) -> Any:
    """The environment class `type_` names (built-in or import path); `ImportPathError` if not."""
    path = BUILTIN_ENVS.get(type_, type_)
    if path is type_ and ":" not in type_ and "." not in type_:
        raise ImportPathError(
            f"unknown environment {type_!r}; built-ins: {sorted(BUILTIN_ENVS)}, or an import path 'pkg.module:Class'"
        )
    return import_object(path, what="environment")


def _options(cls: Any, options: dict[str, Any]) -> tuple[Any, list[Problem]]:
    config_cls = getattr(cls, "Config", None)
    if config_cls is None:
        if options:
            return None, [
                Problem(
                    f"{KEY}.options",
                    f"{getattr(cls, '__name__', cls)!r} takes no options (it has no Config), got {sorted(options)}",
                    "remove rollout.env.options",
                )
            ]
        return None, []
    if not (isinstance(config_cls, type) and issubclass(config_cls, BaseModel)):
        return config_cls(**options), []
    try:
        return config_cls.model_validate(options), []
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            fix = "remove it" if err["type"] == "extra_forbidden" else "set a valid value"
            if err["type"] == "extra_forbidden":
                valid = sorted(config_cls.model_fields)
                fix = f"remove it; valid options: {valid}"
            problems.append(Problem(f"{KEY}.options.{loc}" if loc else f"{KEY}.options", err["msg"], fix))
        return None, problems


def env_config_problems(config: EnvConfig) -> list[Problem]:
    """Every problem of `[rollout.env]` (type resolves, options valid), without running anything."""
    try:
        cls = resolve_env_class(config.type)
    except ImportPathError as exc:
        return [
            Problem(f"{KEY}.type", str(exc), "check the spelling, or install the package that provides it")
        ]
    options, problems = _options(cls, config.options)
    check = getattr(cls, "problems", None)  # deeper checks than the schema (e.g. verifiers' rubric)
    if not problems and callable(check):
        problems = list(check(options, f"{KEY}.options"))
    return problems


def build_env_factory(config: EnvConfig, setup: EnvSetup) -> EnvironmentFactory:
    """The factory of `config`'s environment (raises `ConfigError` listing every problem)."""
    try:
        cls = resolve_env_class(config.type)
    except ImportPathError as exc:
        raise ConfigError([Problem(f"{KEY}.type", str(exc), "check the spelling")]) from exc
    options, problems = _options(cls, config.options)
    if problems:
        raise ConfigError(problems)
    factory = getattr(cls, "factory", None)
    if factory is not None:
        return factory(options, setup)
    if getattr(cls, "Config", None) is None:
        # a fresh `cls()` per episode; not `cls` itself, whose unbound `close` the rollout
        # would call as the factory's own `close` at the end of the run
        return lambda: cls()
    return lambda: cls(options)
