"""The sample metrics every strategy reports: reward mean/std, response lengths, truncation, and
the agentic episode metrics (`rollout/...` for training, `eval/<name>/...` for eval)."""

from __future__ import annotations

import statistics

from verst.rollout.agentic.metrics import agentic_metrics
from verst.rollout.rewards.outcomes import reward_outcome_metrics
from verst.rollout.sample import Sample, Status


def _scalar_rewards(samples: list[Sample], reward_key: str | None) -> list[float]:
    return [
        s.scalar_reward(reward_key) for s in samples if s.reward is not None and s.status is not Status.FAILED
    ]


def sample_metrics(samples: list[Sample], reward_key: str | None, prefix: str) -> dict[str, float]:
    """Reward mean/std, response length mean/max, truncated fraction and reward outcome kinds
    (`<prefix>/reward_outcome/<kind>`) of `samples`."""
    out: dict[str, float] = {}
    if not samples:
        return out
    rewards = _scalar_rewards(samples, reward_key)
    if rewards:
        out[f"{prefix}/reward_mean"] = statistics.fmean(rewards)
        out[f"{prefix}/reward_std"] = statistics.pstdev(rewards)
    lengths = [s.response_length for s in samples]
    out[f"{prefix}/response_length_mean"] = statistics.fmean(lengths)
    out[f"{prefix}/response_length_max"] = float(max(lengths))
    out[f"{prefix}/truncated_frac"] = sum(s.status is Status.TRUNCATED for s in samples) / len(samples)
    out.update(agentic_metrics(samples, prefix))
    out.update(reward_outcome_metrics(samples, prefix))
    return out
