"""Per-turn (process) rewards: each model turn's reward placed on that turn's last token.

With `rollout.env.reward = "per_turn"` an episode keeps the environment's step rewards (the
reward of the step that follows model turn t is turn t's reward; a step without a reward counts
0) and records them as `sample.metadata["turn_reward_positions"]`: `[[index, reward], ...]`,
`index` the response-relative position of the turn's last model token. `sample.reward` is their
sum (the episode's return, for logs and group statistics). The trainer turns the positions into
a `[B, R]` token-reward tensor for the estimators that use them (GAE, `grpo_per_turn`;
docs/algorithms.md) and refuses them for the others.
"""

from __future__ import annotations

from verst.rollout.sample import SEGMENTS_KEY, Sample

POSITIONS_KEY = "turn_reward_positions"
"""`sample.metadata` key of the per-turn rewards at their tokens."""


def turn_reward_positions(sample: Sample) -> list[list[float]]:
    """`[[index, reward], ...]` for each non-empty model segment with a turn reward."""
    rewards = sample.metadata.get("turn_rewards", [])
    out: list[list[float]] = []
    for seg in sample.metadata.get(SEGMENTS_KEY, []):
        turn = seg.get("turn", -1)
        if seg.get("source") != "model" or seg["length"] <= 0 or not 0 <= turn < len(rewards):
            continue
        reward = rewards[turn]
        if reward is not None:
            out.append([seg["start"] + seg["length"] - 1, float(reward)])
    return out


def turn_reward_row(sample: Sample, width: int) -> list[float]:
    """The sample's per-turn rewards as a row of `width` (0 elsewhere)."""
    row = [0.0] * width
    for index, reward in sample.metadata.get(POSITIONS_KEY, []):
        row[int(index)] += reward
    return row
