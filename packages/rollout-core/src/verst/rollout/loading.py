"""Load strategies and generate functions by import path, new style or v1.

`load_rollout_strategy(path, context)`: a class is instantiated with the context; a plain
function with the v1 signature `fn(args, rollout_id, data_source, evaluation=False)` is wrapped
in `LegacyRolloutFnAdapter`.

`load_generate_function(path, config)`: a class is instantiated (with the config when its
constructor takes an argument); a callable taking one argument (`inp: GenerateInput`) is used
as is; a callable taking `(args, sample, sampling_params[, evaluation])` is wrapped in
`LegacyGenerateFnAdapter`. The choice is made by inspecting the signature.

A bad path raises `ImportPathError` naming the module and attribute and telling "not
installed" from "fails on import" (see `verst.rollout.importing`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from verst.rollout.adapters import LegacyGenerateFnAdapter, LegacyRewardFnAdapter, LegacyRolloutFnAdapter
from verst.rollout.config import RolloutConfig
from verst.rollout.importing import import_object
from verst.rollout.protocols import GenerateFn, RolloutContext, RolloutStrategy
from verst.rollout.v1_args import build_v1_args

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _positional_params(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    """The positional parameters of `fn` (for a callable object, of its `__call__`)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"cannot inspect the signature of {fn!r}: {exc}") from exc
    return [p for p in sig.parameters.values() if p.kind in _POSITIONAL]


def _instantiate(cls: type, config: RolloutConfig, path: str, what: str) -> Any:
    required = [p for p in _positional_params(cls) if p.default is inspect.Parameter.empty]
    if not required:
        return cls()
    if len(required) == 1:
        return cls(config)
    raise TypeError(
        f"{what} class {path!r} takes {len(required)} required arguments; it must take none or "
        f"one (the rollout config)"
    )


def load_rollout_strategy(path: str, context: RolloutContext) -> RolloutStrategy:
    """The strategy an import path names: a class built from `context`, or a wrapped v1 function."""
    obj = import_object(path, what="rollout strategy")
    if inspect.isclass(obj):
        return obj(context)
    if not callable(obj):
        raise TypeError(f"rollout strategy {path!r} is a {type(obj).__name__}, not a class or function")
    params = _positional_params(obj)
    if len(params) < 3:
        raise TypeError(
            f"rollout function {path!r} takes {len(params)} positional arguments; a v1 rollout "
            f"function is `fn(args, rollout_id, data_source, evaluation=False)` and a strategy is a "
            f"class built from a RolloutContext"
        )
    return LegacyRolloutFnAdapter(obj, context, path=path)


def load_generate_function(
    path: str, config: RolloutConfig, *, v1_args: Mapping[str, Any] | None = None
) -> GenerateFn:
    """The generate function an import path names, as a `GenerateFn`.

    `v1_args` are the extra settings (`hf_checkpoint`, `sglang_router_ip`, ...) for a v1
    function's `args`.
    """
    obj = import_object(path, what="generate function")
    if inspect.isclass(obj):
        obj = _instantiate(obj, config, path, "generate function")
    if not callable(obj):
        raise TypeError(f"generate function {path!r} is a {type(obj).__name__}, not callable")
    n = len(_positional_params(obj))
    if n == 1:
        return obj
    if n >= 3:
        return LegacyGenerateFnAdapter(obj, build_v1_args(config, **dict(v1_args or {})), path=path)
    raise TypeError(
        f"generate function {path!r} takes {n} positional arguments; write it as "
        f"`async def generate(inp: GenerateInput)` (new style) or "
        f"`async def generate(args, sample, sampling_params, evaluation=False)` (v1)"
    )


def adapt_v1_reward_function(
    fn: Callable[..., Any], config: RolloutConfig, *, v1_args: Mapping[str, Any] | None = None, path: str = ""
) -> Callable[..., Any]:
    """A reward callable: a v1 `fn(args, sample)` (two positional args) is wrapped, others returned as is."""
    if len(_positional_params(fn)) >= 2:
        return LegacyRewardFnAdapter(fn, build_v1_args(config, **dict(v1_args or {})), path=path)
    return fn
