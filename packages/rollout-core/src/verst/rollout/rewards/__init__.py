"""Reward functions: built-in rules, a remote reward model, custom import paths, group rewards.

`build_reward_fns(rollout_config)` is the entry point; see `registry` for the rules.
"""

from verst.rollout.rewards.registry import (
    BUILTIN_REWARDS,
    REMOTE,
    CustomReward,
    RewardError,
    RuleReward,
    build_reward_fns,
    build_sample_reward_fn,
    valid_reward_types,
)

__all__ = [
    "BUILTIN_REWARDS",
    "REMOTE",
    "CustomReward",
    "RewardError",
    "RuleReward",
    "build_reward_fns",
    "build_sample_reward_fn",
    "valid_reward_types",
]
