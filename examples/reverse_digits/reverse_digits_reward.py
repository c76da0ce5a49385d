"""Reward of the reverse-digits example: partial credit with the end-of-sequence counted.

The target of `"6048764="` is `"4678406"` followed by EOS, 8 positions. The reward is the
fraction of those positions the response gets right: each digit in place, and EOS right after
the last digit (the sample finished on a stop token, with exactly `len(label)` characters).
Counting EOS matters: with digits alone a policy loses nothing by never stopping, and GRPO
then drifts into long, truncated answers.

`verst train` puts the config file's folder on `sys.path`, so the config names this function
as `rollout.reward.type = "reverse_digits_reward:reward"`.
"""

from __future__ import annotations

from verst.rollout.rewards.rules import strip_trailing_stop
from verst.rollout.sample import Sample, Status


def score(response: str, label: str, stopped: bool) -> float:
    """Matching positions of `label + EOS` over `len(label) + 1` (in [0, 1])."""
    got = strip_trailing_stop(response)
    digits = sum(a == b for a, b in zip(got, label, strict=False))
    eos = 1 if stopped and len(got) == len(label) else 0
    return (digits + eos) / (len(label) + 1)


def reward(sample: Sample) -> float:
    """The verst reward function (one sample in, a float out)."""
    return score(sample.response, str(sample.label), sample.status == Status.COMPLETED)
