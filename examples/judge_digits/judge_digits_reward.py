"""The true rule of the judge-digits example, for the held-out set only: exact match.

1.0 when the answer is the reference (the prompt's digits reversed) and the policy stopped right
after it (EOS), else 0.0. Training never uses it: the training reward is the judge
(`config.toml`'s `[rollout.reward]`); `[rollout.eval.datasets.heldout.reward]` names this one, so
the held-out score is measured by a rule the policy was never optimised on.
"""

from __future__ import annotations

from verst.rollout.rewards.rules import strip_trailing_stop
from verst.rollout.sample import Sample, Status


def score(response: str, label: str, stopped: bool) -> float:
    """1.0 for exactly `label` then EOS, else 0.0."""
    return 1.0 if stopped and strip_trailing_stop(response) == label else 0.0


def exact(sample: Sample) -> float:
    """The verst reward function (one sample in, a float out)."""
    return score(sample.response, str(sample.label), sample.status == Status.COMPLETED)
