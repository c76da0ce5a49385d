"""Reward of the MoE example: the reverse-digits partial credit with EOS counted (the same
function as `examples/reverse_digits/reverse_digits_reward.py`; `verst train` puts this folder on
`sys.path`, so the config names it `"moe_digits_reward:reward"`)."""

from __future__ import annotations

from verst.rollout.rewards.rules import strip_trailing_stop
from verst.rollout.sample import Sample, Status


def reward(sample: Sample) -> float:
    """Matching positions of `label + EOS` over `len(label) + 1` (in [0, 1])."""
    label = str(sample.label)
    got = strip_trailing_stop(sample.response)
    digits = sum(a == b for a, b in zip(got, label, strict=False))
    eos = 1 if sample.status == Status.COMPLETED and len(got) == len(label) else 0
    return (digits + eos) / (len(label) + 1)
