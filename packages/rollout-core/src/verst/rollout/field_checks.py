"""The rollout config's cross-field checks: each takes the `RolloutConfig` and yields `Problem`s
(sizes, sampling, eval, reward, filters, partial and fully-async rollout, import paths, data
files, environments). `CROSS_FIELD_CHECKS` lists them in order; `validate_rollout_config`
(`verst.rollout.validation`) runs them with the strategy and capability checks.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from verst.rollout.config import DataConfig, RewardConfig, RolloutConfig
from verst.rollout.errors import Problem
from verst.rollout.importing import ImportPathError, import_object, split_import_path
from verst.rollout.rewards.model_checks import model_reward_problems
from verst.rollout.rewards.registry import BUILTIN_REWARDS, REMOTE, is_import_path, valid_reward_types
from verst.rollout.strategies.fully_async_options import FullyAsyncOptions


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
    yield from reward_problems(c.reward, "rollout.reward")
    for name, ds in c.eval.datasets.items():
        if ds.reward is not None:
            yield from reward_problems(ds.reward, f"rollout.eval.datasets.{name}.reward")


def reward_problems(r: RewardConfig, key: str) -> Iterator[Problem]:
    """Problems of one reward table (`rollout.reward`, or an eval dataset's own) at `key`."""
    valid = valid_reward_types()
    if r.type not in valid and not is_import_path(r.type):
        yield Problem(
            f"{key}.type",
            f"unknown reward {r.type!r}",
            f"use one of {valid}, or an import path 'package.module:function'",
        )
    elif is_import_path(r.type):
        try:
            split_import_path(r.type)
        except ImportPathError as exc:
            yield Problem(f"{key}.type", str(exc), "write it as 'package.module:function'")
    if r.type == REMOTE and not r.url:
        yield Problem(
            f"{key}.url",
            "reward.type = 'remote' needs the URL of the reward server",
            f"set {key}.url, e.g. 'http://127.0.0.1:8000/reward'",
        )
    if r.url and r.type != REMOTE:
        yield Problem(
            f"{key}.url",
            f"a URL is set but reward.type = {r.type!r}, so it would be ignored",
            f"set {key}.type = 'remote', or remove {key}.url",
        )
    yield from model_reward_problems(r, key)
    if r.key is not None and r.type in BUILTIN_REWARDS:
        yield Problem(
            f"{key}.key",
            f"the built-in reward {r.type!r} returns a float, so key {r.key!r} selects nothing",
            f"remove {key}.key (it is for rewards that return a dict of named scores)",
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
        *(
            (f"rollout.eval.datasets.{name}.reward.type", ds.reward.type)
            for name, ds in c.eval.datasets.items()
            if ds.reward is not None and is_import_path(ds.reward.type)
        ),
    ]
    for key, path in paths:
        if path is None:
            continue
        try:
            split_import_path(path)
        except ImportPathError:
            if key.endswith("reward.type"):  # reported by _check_reward
                continue
        kind = "reward function" if key.endswith("reward.type") else "dynamic filter"
        yield from import_path_problems(key, path, _PATH_KINDS.get(key, kind))
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
    if c.env.reward == "per_turn_reward_fn" and c.reward.group:
        yield Problem(
            "rollout.env.reward",
            "'per_turn_reward_fn' scores each turn with a per-sample reward, but rollout.reward.group "
            "scores whole groups",
            "set rollout.reward.group = false, or rollout.env.reward = 'reward_fn'",
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
