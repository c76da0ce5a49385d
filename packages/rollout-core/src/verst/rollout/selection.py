"""Which rollout strategy runs, decided once from one effective environment.

The entry point calls `resolve_extra_env_vars` once: `os.environ` merged with the config's
extra env vars (the config wins). That single mapping decides the strategy
(`resolve_strategy_path`) and is what launched processes and Ray runtime envs receive, so the
driver and every worker agree. `use_legacy_rollout_v1` is the only reader of
`VERST_USE_LEGACY_ROLLOUT_V1` in the code base.

Resolution order: an explicit `rollout.rollout_function_path`; else `rollout.fully_async` →
`FullyAsyncRollout`; else the legacy flag → the v1 strategy of `verst-rollout-legacy`; else
the default `InferenceRollout`.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from verst.rollout.config import RolloutConfig

logger = logging.getLogger(__name__)

LEGACY_FLAG = "VERST_USE_LEGACY_ROLLOUT_V1"
"""Environment variable opting into the deprecated v1 function-based rollout (default "0")."""
LEGACY_FLAG_VALUES = {"0": False, "false": False, "1": True, "true": True}
"""Accepted values of the flag (case-insensitive)."""

DEFAULT_STRATEGY_PATH = "verst.rollout.strategies.inference:InferenceRollout"
"""The class-based default strategy."""
FULLY_ASYNC_STRATEGY_PATH = "verst.rollout.strategies.fully_async:FullyAsyncRollout"
"""The fully-async class-based strategy (`rollout.fully_async`)."""
LEGACY_STRATEGY_PATH = "verst.rollout_legacy.strategy:LegacyRolloutStrategy"
"""The v1 strategy, from the optional `verst-rollout-legacy` distribution."""
LEGACY_PACKAGE = "verst.rollout_legacy"
"""Import name of the legacy distribution."""
LEGACY_INSTALL_HINT = "`uv sync --extra legacy` (or `pip install verst[legacy]`)"
"""How to install the legacy distribution."""


@functools.cache
def _legacy_notice() -> None:
    """Log the deprecation notice; cached, so it appears once per process."""
    logger.warning(
        "%s is on: using the deprecated v1 function-based rollout (verst-rollout-legacy). "
        "The class-based RolloutStrategy API is the default; see docs/migration.md to move over.",
        LEGACY_FLAG,
    )


def use_legacy_rollout_v1(env: Mapping[str, str]) -> bool:
    """Whether the effective environment opts into the legacy v1 rollout.

    Raises ValueError for a value other than 0/1/true/false (case-insensitive).
    """
    raw = env.get(LEGACY_FLAG, "0")
    value = LEGACY_FLAG_VALUES.get(raw.strip().lower())
    if value is None:
        raise ValueError(
            f"{LEGACY_FLAG}={raw!r} is not a valid value; use one of {sorted(LEGACY_FLAG_VALUES)} "
            f"(case-insensitive), or unset it for the default class-based rollout"
        )
    if value:
        _legacy_notice()
    return value


def resolve_extra_env_vars(
    extra_env_vars: Mapping[str, str] | None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The effective environment: `environ` (default: `os.environ`) overlaid with the config's vars.

    Call it once at the entry point and pass the result down (to `RolloutContext.env`, to child
    processes, to Ray runtime envs). Values are converted to strings.
    """
    base = os.environ if environ is None else environ
    merged = {str(k): str(v) for k, v in base.items()}
    merged.update({str(k): str(v) for k, v in (extra_env_vars or {}).items()})
    return merged


def resolve_strategy_path(config: RolloutConfig, env: Mapping[str, str]) -> str:
    """The import path of the strategy this config and environment select."""
    if config.rollout_function_path:
        return config.rollout_function_path
    if config.fully_async:
        return FULLY_ASYNC_STRATEGY_PATH
    if use_legacy_rollout_v1(env):
        return LEGACY_STRATEGY_PATH
    return DEFAULT_STRATEGY_PATH
