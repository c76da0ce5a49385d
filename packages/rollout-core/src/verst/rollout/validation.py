"""Validation of the rollout section, before anything heavy loads.

`validate_rollout_config(config, env)` collects every problem and raises them together in one
`ConfigError`, each with its key, why, and fix:

- cross-field checks (`CROSS_FIELD_CHECKS`: sizes, sampling, eval, reward, filters, partial
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
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from verst.rollout.config import DataConfig, RolloutConfig
from verst.rollout.errors import ConfigError, Problem
from verst.rollout.importing import ImportPathError, import_object, split_import_path
from verst.rollout.protocols import Capability, strategy_options_model
from verst.rollout.rewards.registry import BUILTIN_REWARDS, REMOTE, is_import_path, valid_reward_types
from verst.rollout.selection import (
    LEGACY_FLAG,
    LEGACY_FLAG_VALUES,
    LEGACY_INSTALL_HINT,
    LEGACY_PACKAGE,
    LEGACY_STRATEGY_PATH,
    resolve_strategy_path,
    use_legacy_rollout_v1,
)
from verst.rollout.strategies.fully_async_options import FullyAsyncOptions

FindSpec = Callable[[str], ModuleSpec | None]
"""`importlib.util.find_spec`'s shape; injectable so tests can simulate a missing package."""

FULLY_ASYNC_LEGACY_MESSAGE = (
    "--fully-async needs the class-based rollout API; unset VERST_USE_LEGACY_ROLLOUT_V1"
)
"""The exact error for fully-async rollout requested together with the legacy flag."""

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


# --- cross-field checks: each takes the config and yields Problems -----------------------------


def _check_sizes(c: RolloutConfig) -> Iterator[Problem]:
    if c.over_sampling_batch_size is not None and c.over_sampling_batch_size < c.batch_size:
        yield Problem(
            "rollout.over_sampling_batch_size",
            f"{c.over_sampling_batch_size} is smaller than rollout.batch_size = {c.batch_size}; "
            f"each wave must submit at least a batch of groups",
            f"set it to at least {c.batch_size}, or unset it (defaults to batch_size)",
        )


def _check_sampling(c: RolloutConfig) -> Iterator[Problem]:
    if c.top_k == 0 or c.top_k < -1:
        yield Problem(
            "rollout.top_k",
            f"top_k = {c.top_k} is not a valid setting (0 would allow no token)",
            "use -1 to turn top-k off, or a positive k",
        )
    if c.max_context_len is not None and c.max_context_len <= c.max_response_len:
        yield Problem(
            "rollout.max_context_len",
            f"{c.max_context_len} leaves no room for the prompt next to "
            f"rollout.max_response_len = {c.max_response_len}",
            f"raise max_context_len above {c.max_response_len} (plus the longest prompt), "
            f"or lower max_response_len",
        )


def _check_eval(c: RolloutConfig) -> Iterator[Problem]:
    e = c.eval
    ctx, resp = c.max_context_len, e.max_response_len
    if ctx is not None and resp is not None and resp >= ctx:
        yield Problem(
            "rollout.eval.max_response_len",
            f"{resp} leaves no room for the prompt in rollout.max_context_len = {ctx}",
            "lower eval.max_response_len or raise rollout.max_context_len",
        )
    for name, ds in e.datasets.items():
        if e.temperature == 0 and ds.n_samples_per_prompt > 1:
            yield Problem(
                f"rollout.eval.datasets.{name}.n_samples_per_prompt",
                f"{ds.n_samples_per_prompt} samples per prompt with eval.temperature = 0 (greedy) "
                f"are identical copies",
                "set n_samples_per_prompt = 1, or raise rollout.eval.temperature above 0 (e.g. 0.6)",
            )
        yield from _check_data(ds, f"rollout.eval.datasets.{name}", required=True)


def _check_reward(c: RolloutConfig) -> Iterator[Problem]:
    r = c.reward
    valid = valid_reward_types()
    if r.type not in valid and not is_import_path(r.type):
        yield Problem(
            "rollout.reward.type",
            f"unknown reward {r.type!r}",
            f"use one of {valid}, or an import path 'package.module:function'",
        )
    elif is_import_path(r.type):
        try:
            split_import_path(r.type)
        except ImportPathError as exc:
            yield Problem("rollout.reward.type", str(exc), "write it as 'package.module:function'")
    if r.type == REMOTE and not r.url:
        yield Problem(
            "rollout.reward.url",
            "reward.type = 'remote' needs the URL of the reward server",
            "set rollout.reward.url, e.g. 'http://127.0.0.1:8000/reward'",
        )
    if r.url and r.type != REMOTE:
        yield Problem(
            "rollout.reward.url",
            f"a URL is set but reward.type = {r.type!r}, so it would be ignored",
            "set rollout.reward.type = 'remote', or remove rollout.reward.url",
        )
    if r.key is not None and r.type in BUILTIN_REWARDS:
        yield Problem(
            "rollout.reward.key",
            f"the built-in reward {r.type!r} returns a float, so key {r.key!r} selects nothing",
            "remove rollout.reward.key (it is for rewards that return a dict of named scores)",
        )


def _builtin_filter_names() -> list[str]:
    from verst.rollout.strategies.filters import BUILTIN_FILTERS

    return sorted(BUILTIN_FILTERS)


def _check_filters(c: RolloutConfig) -> Iterator[Problem]:
    builtin = _builtin_filter_names()
    for i, name in enumerate(c.dynamic_filters):
        if name not in builtin and not is_import_path(name):
            yield Problem(
                f"rollout.dynamic_filters[{i}]",
                f"unknown dynamic filter {name!r}",
                f"use one of {builtin}, or an import path 'package.module:filter'",
            )
    if "nonzero_std" in c.dynamic_filters and c.n_samples_per_prompt == 1:
        yield Problem(
            "rollout.dynamic_filters",
            "nonzero_std drops every group when rollout.n_samples_per_prompt = 1 (one sample has std 0)",
            "raise n_samples_per_prompt above 1, or remove nonzero_std",
        )


def _check_partial_and_async(c: RolloutConfig) -> Iterator[Problem]:
    if c.mask_offpolicy_in_partial_rollout and not c.partial_rollout:
        yield Problem(
            "rollout.mask_offpolicy_in_partial_rollout",
            "it masks the off-policy part of resumed samples, but rollout.partial_rollout is off",
            "set rollout.partial_rollout = true, or turn mask_offpolicy_in_partial_rollout off",
        )
    # (fully-async with max_weight_staleness = 0 is allowed: FullyAsyncRollout then runs synchronously)
    if not c.fully_async:
        return
    default = FullyAsyncOptions.model_fields["async_buffer_groups"].default
    buffer = c.strategy_options.get("async_buffer_groups", default)
    if isinstance(buffer, int) and buffer < c.batch_size:  # (a bad type: the strategy-options check)
        yield Problem(
            "rollout.strategy_options.async_buffer_groups",
            f"{buffer} cannot hold one batch of rollout.batch_size = {c.batch_size} groups",
            f"set async_buffer_groups >= {c.batch_size} (e.g. {2 * c.batch_size})",
        )


def _module_missing(module: str) -> str | None:
    """Why `module` cannot be found (without executing it), or None when it can."""
    if module in sys.modules:  # already imported (possibly built in memory, without a spec)
        return None
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError as exc:
        return f"module {module!r} is not installed (its package {exc.name!r} is missing)"
    except Exception as exc:  # a parent package fails on import
        return f"module {module!r} cannot be located: {type(exc).__name__}: {exc}"
    return None if found else f"module {module!r} is not installed"


_PATH_KINDS = {
    "rollout.generate_function_path": "generate function",
    "rollout.reward.type": "reward function",
}
"""What each import-path key names (dynamic filters: "dynamic filter")."""


def import_path_problems(key: str, path: str, what: str) -> list[Problem]:
    """Resolve a user import path now (import the module, get the attribute, check it is
    callable), so a path that does not resolve or raises on import is reported under its config
    key, with the fix, before the run directory exists."""
    try:
        module, attr = split_import_path(path)
    except ImportPathError as exc:
        return [Problem(key, str(exc), "write it as 'package.module:attribute'")]
    missing = _module_missing(module)
    if missing:
        return [
            Problem(
                key,
                f"cannot load {what} {path!r}: {missing}",
                "check the spelling, run from the directory that holds the module (a module next to "
                "the config file is found too), or install its package",
            )
        ]
    try:
        obj = import_object(path, what=what)
    except ImportPathError as exc:
        if "has no attribute" in str(exc):
            fix = f"define {attr!r} in module {module!r}, or point {key} at a {what} it defines"
        else:
            fix = f"fix the error raised while importing {module!r} (see the message), then rerun"
        return [Problem(key, str(exc), fix)]
    if not callable(obj):
        return [
            Problem(
                key,
                f"{path!r} is a {type(obj).__name__}, not a {what}",
                f"point {key} at a function (or callable class) in {module!r}",
            )
        ]
    return []


def _check_paths(c: RolloutConfig) -> Iterator[Problem]:
    """User import paths: well formed, importable, naming a callable (resolved now)."""
    paths = [
        ("rollout.generate_function_path", c.generate_function_path),
        ("rollout.reward.type", c.reward.type if is_import_path(c.reward.type) else None),
        *((f"rollout.dynamic_filters[{i}]", f) for i, f in enumerate(c.dynamic_filters) if is_import_path(f)),
    ]
    for key, path in paths:
        if path is None:
            continue
        try:
            split_import_path(path)
        except ImportPathError:
            if key == "rollout.reward.type":  # reported by _check_reward
                continue
        yield from import_path_problems(key, path, _PATH_KINDS.get(key, "dynamic filter"))
    yield from _check_data(c.data, "rollout.data", required=False)


def _check_data(d: DataConfig, key: str, *, required: bool) -> Iterator[Problem]:
    from verst.rollout.data import JSONL_SUFFIXES, PARQUET_SUFFIXES
    from verst.rollout.data_sources import FILE, data_source_problems

    if d.source != FILE or d.options:
        yield from data_source_problems(d, key, eval_set=key != "rollout.data")
        return
    if d.path is None:
        if required:
            yield Problem(f"{key}.path", "no prompt file is set", "set it to a JSONL or Parquet file")
        return
    path = Path(d.path)
    if not path.is_file():
        yield Problem(f"{key}.path", f"{d.path!r} does not exist", "check the path (relative to the cwd)")
    elif path.suffix.lower() not in (*JSONL_SUFFIXES, *PARQUET_SUFFIXES):
        yield Problem(
            f"{key}.path",
            f"unknown file type {path.suffix!r}",
            f"use one of {[*JSONL_SUFFIXES, *PARQUET_SUFFIXES]}",
        )


def _check_env(c: RolloutConfig) -> Iterator[Problem]:
    """`[rollout.env]`: its type resolves, its options fit the environment's Config, and the
    loop's settings agree with the rest of the rollout section."""
    if c.env is None:
        return
    from verst.rollout.agentic.loading import env_config_problems

    yield from env_config_problems(c.env)
    if c.generate_function_path is not None:
        yield Problem(
            "rollout.generate_function_path",
            "a custom generate function and [rollout.env] both decide how samples are generated",
            "remove one: [rollout.env] runs environment episodes with the built-in loop; a custom "
            "generate function builds its own samples (with verst.rollout.agentic.append_turn)",
        )
    if c.env.on_abort == "resume" and not c.partial_rollout:
        yield Problem(
            "rollout.env.on_abort",
            "'resume' keeps aborted episodes' turns, but without rollout.partial_rollout they are "
            "reset to their prompts when handed back",
            "set rollout.partial_rollout = true, or rollout.env.on_abort = 'restart'",
        )
    if (
        c.env.max_tokens is not None
        and c.max_context_len is not None
        and c.env.max_tokens > c.max_context_len
    ):
        yield Problem(
            "rollout.env.max_tokens",
            f"{c.env.max_tokens} exceeds rollout.max_context_len = {c.max_context_len}",
            "lower rollout.env.max_tokens to at most max_context_len, or unset it",
        )


CROSS_FIELD_CHECKS: tuple[Callable[[RolloutConfig], Iterator[Problem]], ...] = (
    _check_env,
    _check_sizes,
    _check_sampling,
    _check_eval,
    _check_reward,
    _check_filters,
    _check_partial_and_async,
    _check_paths,
)
"""Every cross-field check, run in order; each yields its problems."""


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
