"""Validation of the rollout section, before anything heavy loads.

`validate_rollout_config(config, env)` collects every problem and raises them together in one
`ConfigError`, each with its key, why, and fix:

- cross-field checks (`verst.rollout.field_checks.CROSS_FIELD_CHECKS`: sizes, sampling, eval, reward, filters, partial
  rollout, fully-async, data files);
- the strategy selection (`verst.rollout.selection`): a malformed legacy flag, the legacy flag
  while `verst-rollout-legacy` is not installed, fully-async together with the legacy flag;
- capabilities: every feature the config requests (`FEATURE_CAPABILITIES`, plus requests of
  other sections passed as `extra_requests`, e.g. top-k OPD from the trainer) must be in the
  selected strategy's `capabilities`. The strategy module is imported only to read that
  attribute (strategy modules are light; engines and models load later).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from typing import Any

from pydantic import ValidationError

from verst.rollout.config import RolloutConfig
from verst.rollout.errors import ConfigError, Problem
from verst.rollout.field_checks import CROSS_FIELD_CHECKS, import_path_problems
from verst.rollout.importing import ImportPathError, import_object
from verst.rollout.protocols import Capability, strategy_options_model
from verst.rollout.selection import (
    LEGACY_FLAG,
    LEGACY_FLAG_VALUES,
    LEGACY_INSTALL_HINT,
    LEGACY_PACKAGE,
    LEGACY_STRATEGY_PATH,
    resolve_strategy_path,
    use_legacy_rollout_v1,
)

FindSpec = Callable[[str], ModuleSpec | None]
"""`importlib.util.find_spec`'s shape; injectable so tests can simulate a missing package."""

FULLY_ASYNC_LEGACY_MESSAGE = (
    "--fully-async needs the class-based rollout API; unset VERST_USE_LEGACY_ROLLOUT_V1"
)
"""The exact error for fully-async rollout requested together with the legacy flag."""

__all__ = [
    "CROSS_FIELD_CHECKS",
    "FEATURE_CAPABILITIES",
    "FULLY_ASYNC_LEGACY_MESSAGE",
    "FeatureRequest",
    "import_path_problems",
    "requested_capabilities",
    "strategy_option_problems",
    "validate_rollout_config",
]

V1_ROLLOUT_ADAPTER_PATH = "verst.rollout.adapters:LegacyRolloutFnAdapter"
"""The adapter a plain v1 rollout function is wrapped in; its capabilities are the function's."""


@dataclass(frozen=True, slots=True)
class FeatureRequest:
    """A config feature that needs a strategy capability."""

    capability: Capability
    """The capability the selected strategy must declare."""
    key: str
    """The config key that requests it."""
    requested: Callable[[RolloutConfig], bool]
    """Whether `config` requests the feature."""
    fix: str
    """What to do when the strategy lacks it."""


FEATURE_CAPABILITIES: tuple[FeatureRequest, ...] = (
    FeatureRequest(
        Capability.FULLY_ASYNC,
        "rollout.fully_async",
        lambda c: c.fully_async,
        "set rollout.fully_async = false, or use a strategy that supports fully-async rollout",
    ),
    FeatureRequest(
        Capability.PARTIAL_ROLLOUT,
        "rollout.partial_rollout",
        lambda c: c.partial_rollout,
        "set rollout.partial_rollout = false, or use a strategy that supports it",
    ),
    FeatureRequest(
        Capability.MASK_OFFPOLICY_IN_PARTIAL_ROLLOUT,
        "rollout.mask_offpolicy_in_partial_rollout",
        lambda c: c.mask_offpolicy_in_partial_rollout,
        "set rollout.mask_offpolicy_in_partial_rollout = false, or use a strategy that supports it",
    ),
    FeatureRequest(
        Capability.DYNAMIC_FILTER,
        "rollout.dynamic_filters",
        lambda c: bool(c.dynamic_filters),
        "remove rollout.dynamic_filters, or use a strategy that supports dynamic filtering",
    ),
    FeatureRequest(
        Capability.OVER_SAMPLING,
        "rollout.over_sampling_batch_size",
        lambda c: c.effective_over_sampling_batch_size != c.batch_size,
        "unset rollout.over_sampling_batch_size, or use a strategy that supports over-sampling",
    ),
    FeatureRequest(
        Capability.GROUP_REWARD,
        "rollout.reward.group",
        lambda c: c.reward.group,
        "set rollout.reward.group = false, or use a strategy that supports group rewards",
    ),
    FeatureRequest(
        Capability.CUSTOM_GENERATE_FUNCTION,
        "rollout.generate_function_path",
        lambda c: c.generate_function_path is not None,
        "unset rollout.generate_function_path, or use a strategy that supports custom generate functions",
    ),
    FeatureRequest(
        Capability.MULTI_TURN_ENV,
        "rollout.env",
        lambda c: c.env is not None,
        "remove [rollout.env], or use a strategy that supports multi-turn environments "
        "(the default class-based rollout does; unset VERST_USE_LEGACY_ROLLOUT_V1)",
    ),
    FeatureRequest(
        Capability.EVAL,
        "rollout.eval.datasets",
        lambda c: bool(c.eval.datasets),
        "remove rollout.eval.datasets, or use a strategy that supports evaluation",
    ),
)
"""Feature → capability table; a new feature is one entry here."""


def requested_capabilities(config: RolloutConfig) -> dict[Capability, str]:
    """The capabilities `config` needs from its strategy, each with the key that requests it."""
    return {f.capability: f.key for f in FEATURE_CAPABILITIES if f.requested(config)}


# --- strategy selection and capabilities -------------------------------------------------------


def _legacy_installed(find_spec: FindSpec) -> bool:
    try:
        return find_spec(LEGACY_PACKAGE) is not None
    except ModuleNotFoundError:
        return False


def _strategy_key(config: RolloutConfig, legacy: bool) -> str:
    if config.rollout_function_path:
        return "rollout.rollout_function_path"
    if config.fully_async:
        return "rollout.fully_async"
    return LEGACY_FLAG if legacy else "rollout (default strategy)"


def _strategy_capabilities(obj: Any) -> frozenset[Capability] | None:
    """The capabilities a loaded strategy declares (a v1 function: its adapter's)."""
    caps = getattr(obj, "capabilities", None)
    if caps is None and callable(obj) and not isinstance(obj, type):
        try:
            caps = getattr(import_object(V1_ROLLOUT_ADAPTER_PATH), "capabilities", None)
        except ImportPathError:
            return None
    return frozenset(Capability(c) for c in caps) if caps is not None else None


def _strategy_problems(
    config: RolloutConfig, env: Mapping[str, str], requests: Mapping[Capability, str], find_spec: FindSpec
) -> Iterator[Problem]:
    try:
        legacy = use_legacy_rollout_v1(env)
    except ValueError:
        yield Problem(
            LEGACY_FLAG,
            f"{env.get(LEGACY_FLAG)!r} is not a valid value",
            f"set it to one of {sorted(LEGACY_FLAG_VALUES)} (case-insensitive), or unset it",
        )
        legacy = None
    if legacy and config.fully_async:
        yield Problem(
            "rollout.fully_async",
            FULLY_ASYNC_LEGACY_MESSAGE,
            f"unset {LEGACY_FLAG} (in the shell and in the config's extra env vars), "
            f"or set rollout.fully_async = false",
        )
        return
    if legacy is None and not (config.rollout_function_path or config.fully_async):
        return  # the strategy cannot be decided; the flag problem says why
    path = resolve_strategy_path(config, env)
    key = _strategy_key(config, bool(legacy))
    if path == LEGACY_STRATEGY_PATH and not _legacy_installed(find_spec):
        yield Problem(
            LEGACY_FLAG,
            f"{LEGACY_FLAG}=1 selects the v1 rollout, but verst-rollout-legacy is not installed",
            f"install it with {LEGACY_INSTALL_HINT}, or unset {LEGACY_FLAG} "
            f"to use the default class-based rollout",
        )
        return
    try:
        obj = import_object(path, what="rollout strategy")
    except ImportPathError as exc:
        yield Problem(key, str(exc), f"fix the strategy path {path!r} or install the package providing it")
        return
    caps = _strategy_capabilities(obj)
    if caps is None:
        yield Problem(
            key,
            f"strategy {path!r} declares no `capabilities`",
            "give the class `capabilities: ClassVar[frozenset[Capability]] = frozenset({...})`",
        )
        return
    yield from strategy_option_problems(obj, path, config.strategy_options)
    fixes = {f.capability: f.fix for f in FEATURE_CAPABILITIES}
    supported = sorted(c.value for c in caps)
    for cap, req_key in requests.items():
        if cap not in caps:
            yield Problem(
                req_key,
                f"the selected strategy {path!r} does not support {cap.value} (it supports: {supported})",
                fixes.get(cap, f"turn off {req_key}, or select a strategy that supports {cap.value}"),
            )


def strategy_option_problems(strategy: Any, path: str, options: Mapping[str, Any]) -> Iterator[Problem]:
    """`rollout.strategy_options` against the strategy's `Options` model (none = no options)."""
    model = strategy_options_model(strategy)
    if model is None:
        if options:
            yield Problem(
                "rollout.strategy_options",
                f"strategy {path!r} takes no options (it declares no `Options` model)",
                "remove rollout.strategy_options, or give the strategy class an `Options` pydantic model",
            )
        return
    try:
        model.model_validate(dict(options))
    except ValidationError as exc:
        for err in exc.errors():
            key = ".".join(["rollout.strategy_options", *map(str, err["loc"])])
            fields = ", ".join(sorted(model.model_fields))
            yield Problem(key, f"{err['msg']} (got {err.get('input')!r})", f"{path} options: {fields}")


def validate_rollout_config(
    config: RolloutConfig,
    env: Mapping[str, str],
    *,
    extra: Sequence[Problem] = (),
    extra_requests: Mapping[Capability, str] | None = None,
    find_spec: FindSpec = importlib.util.find_spec,
) -> None:
    """Raise one `ConfigError` with every problem of the rollout section (and `extra`), or return.

    `env` is the effective environment (`resolve_extra_env_vars`). `extra_requests` adds
    capabilities other sections need (capability → requesting key), checked against the same
    strategy. `find_spec` decides whether the legacy package is installed (tests override it).
    """
    problems = [p for check in CROSS_FIELD_CHECKS for p in check(config)]
    requests = {**requested_capabilities(config), **(extra_requests or {})}
    problems += _strategy_problems(config, env, requests, find_spec)
    problems += extra
    if problems:
        raise ConfigError(problems)
