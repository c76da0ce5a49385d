"""Per-rollout counts of reward outcome kinds: a reward that records why it scored a sample
(`sample.metadata["reward_outcome"]`, e.g. `code_tests`' `timeout` or `syntax_error`) is counted
as `<prefix>/reward_outcome/<kind>` (samples of that kind among the rollout's kept samples).
"""

from __future__ import annotations

from collections import Counter

from verst.rollout.sample import Sample

REWARD_OUTCOME_KEY = "reward_outcome"
"""`sample.metadata` key of a reward's outcome kind (removed when the sample is reset)."""


def reward_outcome_metrics(samples: list[Sample], prefix: str) -> dict[str, float]:
    """`<prefix>/reward_outcome/<kind>`: how many of `samples` had each outcome kind."""
    kinds = Counter(str(s.metadata[REWARD_OUTCOME_KEY]) for s in samples if REWARD_OUTCOME_KEY in s.metadata)
    return {f"{prefix}/reward_outcome/{kind}": float(n) for kind, n in sorted(kinds.items())}
