"""Full trajectories: which samples a run records in full, and the `trajectories.jsonl` line of one.

A run records the whole trajectory — every token id, its text, the loss mask, the engine's
log-prob, the trainer's log-prob at the step's old weights, the advantage, the weight version,
the segments (turns, tool calls, observations) and per-token MoE routing when the sample has it
— for a bounded choice of samples per step (`run.record.trajectories_per_step`, the lowest
sample indices) and for every failed or aborted sample. One JSON object per line::

    {"step", "rollout_id", "split", "group_index", "sample_index", "attempt",
     "reason": "sampled" | "failed" | "aborted",
     "status", "reward", "label", "error",
     "prompt": <text or chat messages, in full>, "response": <text, in full>,
     "prompt_length", "response_length",
     "tokens": [prompt + response ids], "token_text": [one string per id],
     "loss_mask": [per response token 0/1], "rollout_logprobs": [per response token] | null,
     "trainer_logprobs": [per response token] | null, "advantages": [per response token] | null,
     "token_versions": [per response token] | null, "weight_versions": [...],
     "segments": [{"source": "model" | "env", "start", "length", "turn", "weight_version",
                   "trainable"}] (response-relative; one model segment for a single-turn sample),
     "routed_experts": {"width": layers × k, "per_token": [[expert ids] per response token]} | null,
     "env": {"termination", "turn_rewards", "env_info", "env_metrics"} | null,
     "truncated_tokens": <ids cut by `run.record.max_tokens`, 0 when whole>}

`verst.trainer.dashboard.trajectories.read_trajectories(run_dir)` is the documented way to read
them (docs/dashboard.md); `RunRecorder` (`verst.trainer.run.recording`) writes them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from verst.rollout.sample import Sample, Status

TRAJECTORIES_FILE = "trajectories.jsonl"
"""Full trajectories, in the run directory."""
_ENV_KEYS = ("termination", "turn_rewards", "env_info", "env_metrics")

Decode = Callable[[Sequence[int]], "list[str] | None"]
"""Token ids -> one display string per id (None: no text to show)."""


@dataclass(frozen=True, slots=True)
class TokenDetail:
    """What the train step measured for one sample, per response token."""

    advantages: list[float] | None
    trainer_logprobs: list[float] | None
    """The trainer's log-probs at the step's old weights (None where this rank did not score it)."""


@dataclass(frozen=True, slots=True)
class StepDetail:
    """What one train step measured, by (group_index, sample_index): every trained sample's mean
    advantage over its trained tokens, and the per-token values of the samples recorded in full."""

    advantages: dict[tuple[Any, Any], float] = field(default_factory=dict)
    tokens: dict[tuple[Any, Any], TokenDetail] = field(default_factory=dict)


def choose_trajectories(samples: Iterable[Sample], per_step: int) -> dict[tuple[Any, Any], str]:
    """(group_index, sample_index) -> reason, for the samples of one step to record in full:
    the `per_step` lowest sample indices ("sampled") and every failed or aborted one."""
    chosen: dict[tuple[Any, Any], str] = {}
    rest = []
    for s in samples:
        key = (s.group_index, s.sample_index)
        if s.status in (Status.FAILED, Status.ABORTED):
            chosen[key] = s.status.value
        else:
            rest.append((s.sample_index if s.sample_index is not None else 1 << 62, key))
    for _, key in sorted(rest, key=lambda t: t[0])[: max(0, per_step)]:
        chosen[key] = "sampled"
    return chosen


def _finite(value: Any) -> Any:
    """`value` with NaN / infinite floats (not JSON) replaced by None, through dicts and lists."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _floats(values: Any, n: int) -> list[float] | None:
    if values is None:
        return None
    out = [float(v) for v in list(values)[:n]]
    return [v if v == v and abs(v) != float("inf") else None for v in out]  # type: ignore[misc]


def record_key(sample: Sample, *, step: int, rollout_id: int | None, split: str) -> dict[str, Any]:
    """The fields that name a sample's line in `samples.jsonl` and `trajectories.jsonl` (`step`
    first, so readers can index cheaply)."""
    return {
        "step": step,
        "rollout_id": rollout_id,
        "split": split,
        "group_index": sample.group_index,
        "sample_index": sample.sample_index,
    }


def trajectory_record(
    sample: Sample,
    *,
    step: int,
    rollout_id: int | None,
    split: str,
    reason: str,
    decode: Decode | None = None,
    detail: TokenDetail | None = None,
    max_tokens: int = 16384,
) -> dict[str, Any]:
    """The `trajectories.jsonl` line of one sample (ids beyond `max_tokens` are cut and counted)."""
    tokens = list(sample.tokens)
    plen = sample.prompt_length
    keep = min(len(tokens), max_tokens)
    r_keep = max(0, keep - plen)
    error = sample.metadata.get("error")
    routed = getattr(sample, "routed_experts", None)
    env = {k: sample.metadata[k] for k in _ENV_KEYS if k in sample.metadata}
    detail = detail or TokenDetail(None, None)
    return {
        **record_key(sample, step=step, rollout_id=rollout_id, split=split),
        "attempt": sample.metadata.get("attempt"),
        "reason": reason,
        "status": sample.status.value,
        "reward": _finite(sample.reward),
        "label": _finite(sample.label),
        "error": None if error is None else str(error),
        "prompt": sample.prompt,
        "response": sample.response,
        "prompt_length": plen,
        "response_length": sample.response_length,
        "tokens": tokens[:keep],
        "token_text": decode(tokens[:keep]) if decode is not None and keep else None,
        "loss_mask": sample.effective_loss_mask()[:r_keep],
        "rollout_logprobs": _floats(sample.rollout_logprobs, r_keep),
        "trainer_logprobs": _floats(detail.trainer_logprobs, r_keep),
        "advantages": _floats(detail.advantages, r_keep),
        "token_versions": None if sample.token_versions is None else list(sample.token_versions)[:r_keep],
        "weight_versions": list(sample.weight_versions),
        "segments": sample.metadata.get("segments") or _single_segment(sample),
        "routed_experts": _routing(routed, plen, r_keep) if routed is not None else None,
        "env": _finite(env) or None,
        "truncated_tokens": len(tokens) - keep,
    }


def _single_segment(sample: Sample) -> list[dict[str, Any]]:
    if not sample.response_length:
        return []
    version = sample.weight_versions[-1] if sample.weight_versions else None
    return [
        {
            "source": "model",
            "start": 0,
            "length": sample.response_length,
            "turn": 0,
            "weight_version": version,
            "trainable": True,
        }
    ]


def _routing(routed: Any, prompt_length: int, n: int) -> dict[str, Any] | None:
    """Per response token, the experts the engine routed it through: `{"width", "per_token"}`.

    `Sample.routed_experts` (`verst.rollout.moe.RoutedExperts`) holds one row of `layers × k` ids
    per input position; row `j` predicts token `j + 1`, so response token `i` comes from row
    `prompt_length - 1 + i`. -1 marks positions without a recorded choice (observations)."""
    to_ints, width = getattr(routed, "to_ints", None), getattr(routed, "width", None)
    if to_ints is None or not isinstance(width, int) or width < 1:
        return None
    flat, rows = to_ints(), int(getattr(routed, "tokens", 0))
    per_token = []
    for i in range(n):
        j = prompt_length - 1 + i
        per_token.append(flat[j * width : (j + 1) * width] if 0 <= j < rows else [-1] * width)
    return {"width": width, "per_token": per_token}


def write_lines(fh: Any, records: Iterable[Mapping[str, Any]]) -> int:
    """Append records as JSON lines (one write, flushed); returns how many."""
    lines = [json.dumps(r, default=str, ensure_ascii=False, allow_nan=False) + "\n" for r in records]
    fh.write("".join(lines))
    fh.flush()
    return len(lines)
