"""Turning `rollout.reward` into reward functions.

`rollout.reward.type` is one of:
- a built-in rule from `BUILTIN_REWARDS` (`exact_match`, `math`, `partial_credit`);
- a sandboxed code reward from `CODE_REWARDS` (`code_tests`, `code_tests_binary`: the row's
  tests run against the sample's code in `rollout.reward.sandbox`, `code_tests.CodeTestsReward`);
- `"remote"`: a reward model served over HTTP at `rollout.reward.url` (`RemoteRewardModel`);
- an import path `"pkg.module:fn"` of a custom function, sync or async. Its signature decides
  how it is called: `fn(sample)` (new style) or `fn(args, sample)` (slime/miles v1, `args` from
  `verst.rollout.v1_args.build_v1_args`); with `rollout.reward.group`, `fn(samples)` or
  `fn(args, samples)` returning one reward per sample. A class is instantiated without arguments.

Rewards are floats or dicts of floats (`rollout.reward.key` picks the trained one). A reward
function that raises, or returns something else, raises `RewardError` naming the function;
the strategy records it on the sample and counts it in metrics.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from verst.rollout.importing import import_object
from verst.rollout.protocols import GroupRewardFn, RewardFn, RewardValue
from verst.rollout.rewards.math_grading import grade_math
from verst.rollout.rewards.rules import exact_match, partial_credit, strip_trailing_stop
from verst.rollout.sample import Sample

if TYPE_CHECKING:
    from verst.rollout.config import RolloutConfig

RuleFn = Callable[[str, Any], float]
"""A rule reward: `(response text, label) -> float`."""


def _reasoning_gym(response: str, label: Any) -> float:
    """reasoning-gym's `score_answer` for the entry in `label` (imported only when used)."""
    from verst.rollout.integrations.reasoning_gym_data import score_answer

    return score_answer(response, label)


BUILTIN_REWARDS: dict[str, RuleFn] = {
    "exact_match": exact_match,
    "math": grade_math,
    "partial_credit": partial_credit,
    "reasoning_gym": _reasoning_gym,
}
"""Built-in rule rewards by name: the one table a new rule is added to."""

CODE_REWARDS: dict[str, bool] = {"code_tests": False, "code_tests_binary": True}
"""Sandboxed code rewards by name -> whether the score is binary (1 only when every test passes)."""

REMOTE = "remote"
"""`rollout.reward.type` of a reward model served over HTTP."""

MODEL_REWARDS = ("judge", "reward_model")
"""`rollout.reward.type`s scored by a model verst runs: a judge (`judge.JudgeReward`, section
`rollout.reward.judge`) and a sequence-classifier (`reward_model.RewardModelReward`)."""


class RewardError(RuntimeError):
    """A reward function raised or returned an invalid value; the message names the function."""


def is_import_path(name: str) -> bool:
    """True for `"pkg.mod:fn"` / `"pkg.mod.fn"`, False for built-in names."""
    return ":" in name or "." in name


def valid_reward_types() -> list[str]:
    """Names accepted by `rollout.reward.type` besides import paths."""
    return [*BUILTIN_REWARDS, *CODE_REWARDS, REMOTE, *MODEL_REWARDS]


def check_reward_value(value: Any, where: str) -> RewardValue:
    """`value` as a float or dict of floats, or `RewardError` naming `where`."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, dict) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values()
    ):
        return {str(k): float(v) for k, v in value.items()}
    raise RewardError(
        f"{where} returned {type(value).__name__} {value!r:.100}; "
        f"a reward must be a float or a dict of floats"
    )


class RuleReward:
    """A built-in rule as an async `RewardFn` (a trailing EOS / stop string is ignored)."""

    def __init__(self, name: str, rule: RuleFn, stops: Sequence[str] = ()) -> None:
        self.name = name
        """Registry name, for error messages."""
        self.rule = rule
        """The rule function."""
        self.stops = tuple(stops)
        """Stop strings stripped from the end of the response."""

    async def __call__(self, sample: Sample) -> RewardValue:
        return self.score(sample)

    def score(self, sample: Sample) -> float:
        """Synchronous scoring (rules do no I/O)."""
        try:
            return float(self.rule(strip_trailing_stop(sample.response, self.stops), sample.label))
        except Exception as exc:
            raise RewardError(f"built-in reward {self.name!r} raised {type(exc).__name__}: {exc}") from exc


def _positional_arity(fn: Callable[..., Any], path: str) -> int:
    """Number of positional parameters without a default (1 = new style, 2 = v1)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise RewardError(f"cannot inspect the signature of reward function {path!r}: {exc}") from exc
    params = [
        p
        for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    return len(params)


class CustomReward:
    """A user function loaded by import path, called new style or v1 style (sync or async)."""

    def __init__(self, path: str, fn: Callable[..., Any], v1_args: Any = None, *, group: bool) -> None:
        self.path = path
        """The import path, for error messages."""
        self.fn = fn
        """The user's callable."""
        self.v1_args = v1_args
        """The v1 `args` namespace, or None for new-style functions."""
        self.group = group
        """Whether `fn` scores a list of samples."""

    @classmethod
    def load(cls, path: str, config: RolloutConfig, *, group: bool) -> CustomReward:
        """Import `path` and decide new style vs v1 from its signature."""
        fn = import_object(path, what="group reward function" if group else "reward function")
        if inspect.isclass(fn):
            fn = fn()
        if not callable(fn):
            raise RewardError(f"reward function {path!r} is a {type(fn).__name__}, not a callable")
        arity = _positional_arity(fn, path)
        what = "samples" if group else "sample"
        if arity == 1:
            return cls(path, fn, group=group)
        if arity == 2:
            from verst.rollout.v1_args import build_v1_args

            return cls(path, fn, build_v1_args(config), group=group)
        raise RewardError(
            f"reward function {path!r} takes {arity} required positional arguments; "
            f"write it as fn({what}) or, v1 style, fn(args, {what})"
        )

    async def _call(self, arg: Any) -> Any:
        args = (arg,) if self.v1_args is None else (self.v1_args, arg)
        try:
            result = self.fn(*args)
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:
            raise RewardError(f"reward function {self.path!r} raised {type(exc).__name__}: {exc}") from exc
        return result

    async def __call__(self, sample: Sample) -> RewardValue:
        return check_reward_value(await self._call(sample), f"reward function {self.path!r}")

    async def score_group(self, samples: list[Sample]) -> list[RewardValue]:
        """Group scoring: one reward per sample, in order."""
        result = await self._call(samples)
        if not isinstance(result, (list, tuple)) or len(result) != len(samples):
            raise RewardError(
                f"group reward function {self.path!r} returned {type(result).__name__} "
                f"{result!r:.100} for {len(samples)} samples; return a list with one reward per sample"
            )
        return [check_reward_value(v, f"group reward function {self.path!r}") for v in result]


class GroupOfSampleRewards:
    """A `GroupRewardFn` scoring each sample with a per-sample reward, concurrently."""

    def __init__(self, reward_fn: RewardFn) -> None:
        self.reward_fn = reward_fn
        """The per-sample reward applied to each member."""

    async def __call__(self, samples: list[Sample]) -> list[RewardValue]:
        return list(await asyncio.gather(*(self.reward_fn(s) for s in samples)))


class CustomGroupReward:
    """A custom group reward as a `GroupRewardFn`."""

    def __init__(self, custom: CustomReward) -> None:
        self.custom = custom
        """The loaded user function."""

    async def __call__(self, samples: list[Sample]) -> list[RewardValue]:
        return await self.custom.score_group(samples)


def build_sample_reward_fn(config: RolloutConfig) -> RewardFn:
    """The per-sample reward `rollout.reward.type` names (built-in, remote or import path)."""
    reward = config.reward
    if reward.type in BUILTIN_REWARDS:
        return RuleReward(reward.type, BUILTIN_REWARDS[reward.type], config.stop)
    if reward.type in CODE_REWARDS:
        from verst.rollout.rewards.code_tests import CodeTestsReward

        return CodeTestsReward(reward.sandbox, binary=CODE_REWARDS[reward.type], stops=config.stop)
    if reward.type == REMOTE:
        if not reward.url:
            raise RewardError("rollout.reward.type = 'remote' needs rollout.reward.url")
        from verst.rollout.rewards.remote import RemoteRewardModel

        return RemoteRewardModel(
            reward.url, timeout_s=reward.timeout_s, max_connections=config.max_concurrency
        )
    if reward.type in MODEL_REWARDS:
        return _model_reward(config)
    if is_import_path(reward.type):
        return CustomReward.load(reward.type, config, group=False)
    raise RewardError(
        f"unknown rollout.reward.type {reward.type!r}; valid: {valid_reward_types()} "
        f"or an import path 'package.module:function'"
    )


def _model_reward(config: RolloutConfig) -> RewardFn:
    """A judge or reward-model reward from its section (docs/rewards.md)."""
    reward = config.reward
    if reward.type == "judge":
        if reward.judge is None:
            raise RewardError("rollout.reward.type = 'judge' needs a [rollout.reward.judge] section")
        from verst.rollout.rewards.judge import JudgeReward

        return JudgeReward.from_config(reward.judge)
    if reward.reward_model is None:
        raise RewardError(
            "rollout.reward.type = 'reward_model' needs a [rollout.reward.reward_model] section"
        )
    from verst.rollout.rewards.reward_model import RewardModelReward

    return RewardModelReward(reward.reward_model)


def build_reward_fns(rollout_config: RolloutConfig) -> tuple[RewardFn | None, GroupRewardFn | None]:
    """`(reward_fn, None)`, or `(None, group_reward_fn)` when `rollout.reward.group` is on.

    With `group` on, a custom import path is a group function; a built-in or remote reward
    scores each member of the group.
    """
    reward = rollout_config.reward
    if not reward.group:
        return build_sample_reward_fn(rollout_config), None
    if is_import_path(reward.type) and reward.type != REMOTE:
        return None, CustomGroupReward(CustomReward.load(reward.type, rollout_config, group=True))
    return None, GroupOfSampleRewards(build_sample_reward_fn(rollout_config))
