"""Per-turn (process) rewards: each model turn's reward placed on that turn's last token.

With `rollout.env.reward = "per_turn"` an episode keeps the environment's step rewards (the
reward of the step that follows model turn t is turn t's reward; a step without a reward counts
0) and records them as `sample.metadata["turn_reward_positions"]`: `[[index, reward], ...]`,
`index` the response-relative position of the turn's last model token. `sample.reward` is their
sum (the episode's return, for logs and group statistics). The trainer turns the positions into
a `[B, R]` token-reward tensor for the estimators that use them (GAE, `grpo_per_turn`;
docs/algorithms.md) and refuses them for the others.

With `rollout.env.reward = "per_turn_reward_fn"` the turn rewards come from `rollout.reward`
instead (any kind: a judge, a rule, a custom function), which scores each model turn once the
episode ends (`score_turns`, the turns concurrently): the sample it sees for turn t has the
episode's prompt followed by the transcript before the turn as `prompt` (text, decoded from the
exact tokens), the turn's text as `response`, the episode's `label` and a copy of its metadata
with `"turn": t`, status COMPLETED (the last turn: the episode's own). The scores take the places
env step rewards take with `per_turn`. A reward that fails marks the episode FAILED (a reward
error, counted as usual).
"""

from __future__ import annotations

import asyncio
from typing import Any

from verst.rollout.logging_utils import sample_text_preview
from verst.rollout.sample import SEGMENTS_KEY, Sample, Status

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


def turn_samples(sample: Sample, tokenizer: Any) -> list[tuple[int, Sample]]:
    """`(turn, view)` for each non-empty model segment: the sample a reward scores that turn by
    (see the module docstring)."""
    prompt_len = len(sample.tokens) - sample.response_length
    head = sample.prompt if isinstance(sample.prompt, str) else tokenizer.decode(sample.tokens[:prompt_len])
    segments = [
        g for g in sample.metadata.get(SEGMENTS_KEY, []) if g["source"] == "model" and g["length"] > 0
    ]
    out = []
    for i, seg in enumerate(segments):
        start = prompt_len + seg["start"]
        before = tokenizer.decode(sample.tokens[prompt_len:start]) if seg["start"] else ""
        last = i == len(segments) - 1
        view = Sample(
            prompt=head + before,
            response=tokenizer.decode(sample.tokens[start : start + seg["length"]]),
            label=sample.label,
            status=sample.status if last else Status.COMPLETED,
            metadata={**sample.metadata, "turn": seg["turn"]},
        )
        out.append((seg["turn"], view))
    return out


async def score_turns(sample: Sample, reward_fn: Any, tokenizer: Any, reward_key: str | None) -> None:
    """Score each model turn of a finished episode with `reward_fn` (`per_turn_reward_fn`):
    `turn_rewards`, their positions and `sample.reward` (their sum); FAILED if the reward fails."""
    if reward_fn is None:
        raise ValueError(
            "rollout.env.reward = 'per_turn_reward_fn' needs a per-sample rollout.reward "
            "(rollout.reward.group scores whole groups, not turns): set rollout.reward.group = false"
        )
    views = turn_samples(sample, tokenizer)
    try:
        scores = await asyncio.gather(*(reward_fn(view) for _, view in views))
        for (_, view), score in zip(views, scores, strict=True):
            view.reward = score
        values = [view.scalar_reward(reward_key) for _, view in views]
    except Exception as exc:
        sample.status = Status.FAILED
        sample.metadata["error"] = f"reward: {type(exc).__name__}: {sample_text_preview(str(exc), 300)}"
        return
    rewards: list[float | None] = [None] * (max((t for t, _ in views), default=-1) + 1)
    for (turn, _), value in zip(views, values, strict=True):
        rewards[turn] = value
    sample.metadata["turn_rewards"] = rewards
    sample.metadata[POSITIONS_KEY] = turn_reward_positions(sample)
    sample.reward = float(sum(values))
