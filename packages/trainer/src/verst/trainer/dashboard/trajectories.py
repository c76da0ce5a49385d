"""Full trajectories: the `trajectories.jsonl` record of a run, and the reader to get them out.

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

`read_trajectories(run_dir)` is the documented way to read them (see docs/dashboard.md).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verst.rollout.sample import Sample, Status
from verst.trainer.dashboard.tail import JsonlTail

TRAJECTORIES_FILE = "trajectories.jsonl"
"""Full trajectories, in the run directory."""
_ENV_KEYS = ("termination", "turn_rewards", "env_info", "env_metrics")

Decode = Callable[[Sequence[int]], list[str]]
"""Token ids -> one display string per id."""


@dataclass(frozen=True, slots=True)
class TokenDetail:
    """What the train step measured for one sample, per response token."""

    advantages: list[float] | None
    trainer_logprobs: list[float] | None
    """The trainer's log-probs at the step's old weights (None where this rank did not score it)."""


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


def _floats(values: Any, n: int) -> list[float] | None:
    if values is None:
        return None
    out = [float(v) for v in list(values)[:n]]
    return [v if v == v and abs(v) != float("inf") else None for v in out]  # type: ignore[misc]


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
        "step": step,
        "rollout_id": rollout_id,
        "split": split,
        "group_index": sample.group_index,
        "sample_index": sample.sample_index,
        "attempt": sample.metadata.get("attempt"),
        "reason": reason,
        "status": sample.status.value,
        "reward": sample.reward,
        "label": sample.label,
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
        "env": env or None,
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


# ---------------------------------------------------------------- reading


def read_trajectories(
    run_dir: str | Path,
    *,
    step: int | None = None,
    split: str | None = None,
    sample_index: int | None = None,
) -> Iterator[dict[str, Any]]:
    """The full trajectories a run recorded (`trajectories.jsonl`), in file order, optionally only
    those of one `step`, `split` (`train`, `eval/<dataset>`) or `sample_index`.

    Lines that do not parse (a crash mid-write) are skipped. Each record is described in this
    module's docstring; `turns(record)` splits one into its segments with their text."""
    path = Path(run_dir) / TRAJECTORIES_FILE
    if not path.exists():
        return
    with path.open("rb") as fh:
        for line in fh:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict):
                continue
            if step is not None and record.get("step") != step:
                continue
            if split is not None and record.get("split") != split:
                continue
            if sample_index is not None and record.get("sample_index") != sample_index:
                continue
            yield record


def turns(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The trajectory's response as segments, each with its ids, text, loss mask and log-probs:
    `[{"source", "turn", "start", "ids", "text", "loss_mask", "rollout_logprobs", ...}]`."""
    plen = int(record["prompt_length"])
    ids, texts = record["tokens"], record.get("token_text")
    out = []
    for seg in record.get("segments") or []:
        lo, hi = seg["start"], seg["start"] + seg["length"]

        def part(key: str, lo: int = lo, hi: int = hi) -> list[Any] | None:
            values = record.get(key)
            return None if values is None else values[lo:hi]

        out.append(
            {
                **seg,
                "ids": ids[plen + lo : plen + hi],
                "text": None if texts is None else "".join(texts[plen + lo : plen + hi]),
                "loss_mask": part("loss_mask"),
                "rollout_logprobs": part("rollout_logprobs"),
                "trainer_logprobs": part("trainer_logprobs"),
                "advantages": part("advantages"),
            }
        )
    return out


_HEAD = re.compile(
    rb'^\{"step": (-?\d+), "rollout_id": [^,]*, "split": "([^"\\]*)", "group_index": [^,]*, '
    rb'"sample_index": (-?\d+)'
)


class TrajectoryIndex:
    """`trajectories.jsonl` of a run indexed by (step, split, sample_index) -> byte offset, read
    incrementally like the other files (the dashboard's trajectory view). It has its own lock and
    is read when a view needs it, never by `RunData.refresh`: a large file of long trajectories
    never holds up the timeline."""

    def __init__(self, root: Path) -> None:
        self._lock = threading.Lock()
        self.tail = JsonlTail(root / TRAJECTORIES_FILE)
        self.offsets: dict[tuple[int, str], dict[int, int]] = {}
        """(step, split) -> sample_index -> byte offset of its line."""

    def read(self) -> int:
        """Index the lines the file gained; returns how many trajectories are indexed."""
        with self._lock:
            self._read()
            return sum(len(v) for v in self.offsets.values())

    def _read(self) -> None:
        for offset, line in self.tail.raw_lines():
            m = _HEAD.match(line)
            if m is not None:
                step, split, index = int(m.group(1)), m.group(2).decode("utf-8", "replace"), int(m.group(3))
            else:
                record = self.tail.parse(line)
                if record is None:
                    continue
                step, index = record.get("step"), record.get("sample_index")
                if not (isinstance(step, int) and isinstance(index, int)):
                    self.tail.count_malformed()
                    continue
                split = str(record.get("split", "train"))
            self.offsets.setdefault((step, split), {})[index] = offset  # a later line wins

    def keys_of(self, step: int, split: str) -> set[int]:
        """Sample indices of `step` and `split` that have a recorded trajectory."""
        with self._lock:
            return set(self.offsets.get((step, split), {}))

    def get(self, step: int, split: str, sample_index: int) -> dict[str, Any] | None:
        """The recorded trajectory, or None."""
        with self._lock:
            offset = self.offsets.get((step, split), {}).get(sample_index)
        if offset is None:
            return None
        try:
            with self.tail.path.open("rb") as fh:
                fh.seek(offset)
                record = json.loads(fh.readline())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None
