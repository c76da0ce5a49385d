"""A synthetic run directory in the formats a real run writes (for the load benchmark and tests).

Lines come from the real writers' code (`LifecycleEvent.to_dict`, `recording.sample_record`,
the metrics row layout), so the synthetic files cannot drift from what a run writes. Options add
agentic sub-spans (`turn_*` / `tool_*` events with durations), retries, failures and unfinished
attempts, so every timeline feature can be exercised without a long run.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from verst.rollout.agentic.trajectory import append_turn
from verst.rollout.lifecycle import JsonlSink, LifecycleEvent
from verst.rollout.sample import Sample, Status
from verst.trainer.run.recording import SAMPLES_FILE, STATUS_FILE, sample_record
from verst.trainer.run.trajectories import (
    TRAJECTORIES_FILE,
    TokenDetail,
    trajectory_record,
    write_lines,
)

_STATUSES = (Status.COMPLETED, Status.TRUNCATED, Status.ABORTED, Status.FAILED)


class _Kind(str):
    """An event kind that need not be an `EventKind` member (agentic kinds such as `turn_start`)."""

    @property
    def value(self) -> str:
        return str(self)


_VOCAB = "abcdefghijklmnopqrstuvwxyz0123456789 +=.?:\n<>/_"
"""The synthetic runs' tokens: id k is the character _VOCAB[k] (plus a few multi-character ids)."""
_SPECIAL = {
    100: "<tool_call>",
    101: "</tool_call>",
    102: "<tool_response>",
    103: "</tool_response>",
    104: "<eos>",
}


def decode(ids: list[int]) -> list[str]:
    """One display string per synthetic token id."""
    return [_SPECIAL.get(i) or (_VOCAB[i] if 0 <= i < len(_VOCAB) else f"<{i}>") for i in ids]


_ID_OF = {c: k for k, c in enumerate(_VOCAB)}
_LOGPROBS = [round(-random.Random(7).random() * 2, 4) for _ in range(4099)]
"""A fixed log-prob pattern (per-token random draws made the big benchmark run slow to write)."""


def _ids(text: str) -> list[int]:
    return [_ID_OF[c] for c in text if c in _ID_OF]


def _sample(
    rng: random.Random,
    rid: int,
    i: int,
    group: int,
    status: Status,
    reward,
    attempt: int,
    *,
    agentic: bool,
    pad: int = 0,
) -> Sample:
    """One sample with real token ids, loss mask, log-probs and segments (built with `append_turn`)."""
    prompt = f"what is {i} + {rid}? answer:"
    sample = Sample(
        prompt=prompt, label=str(i + rid), tokens=_ids(prompt), reward=reward, status=status,
        metadata={"attempt": attempt}, group_index=group, sample_index=i,
    )  # fmt: skip
    filler = " let me check that again." * (pad // 25 + 1) if pad else ""
    answer = [*_ids(f"{filler[:pad]} the answer is {i + rid}."), 104]

    def lps(n: int) -> list[float]:
        k = rng.randrange(len(_LOGPROBS))
        return [_LOGPROBS[(k + j) % len(_LOGPROBS)] for j in range(n)]

    if agentic:
        call = [100, *_ids(f"{i}+{rid}"), 101]
        append_turn(sample, call, lps(len(call)), True, rid, text=f"<tool_call>{i}+{rid}</tool_call>")
        obs = [102, *_ids(str(i + rid)), 103]
        append_turn(sample, obs, None, False, text=f"<tool_response>{i + rid}</tool_response>")
    append_turn(sample, answer, lps(len(answer)), True, rid, text=f"{filler[:pad]} the answer is {i + rid}.")
    if status is Status.FAILED:
        sample.metadata["error"] = "reward: ValueError: could not parse the answer"
    return sample


@dataclass
class _StepWriter:
    """Writes one step's events, sample lines and full trajectories (the options of
    `write_synthetic_run`)."""

    rng: random.Random
    sink: JsonlSink
    samples: IO[str]
    trajectories: IO[str]
    group_size: int
    agentic: bool
    multi: bool
    retry_every: int
    unfinished_every: int
    trajectories_per_step: int
    trajectory_tokens: int

    def step(self, rid: int, step_t0: float, samples_per_step: int) -> list[float]:
        """Every sample of rollout `rid`; returns their scalar rewards."""
        rewards = []
        for i in range(samples_per_step):
            group = i // self.group_size
            start = step_t0 + self.rng.random() * 0.05
            attempts = 2 if self.retry_every and i % self.retry_every == 0 else 1
            status = _STATUSES[0] if self.rng.random() < 0.85 else self.rng.choice(_STATUSES[1:])
            for attempt in range(attempts):
                start = self._attempt(rid, group, i, attempt, start, status, last=attempt == attempts - 1)
            rewards.append(self._record(rid, group, i, status, attempts))
        return rewards

    def _emit(self, kind: str, rid: int, group: int, index: int, ts: float, detail: dict) -> None:
        self.sink.emit(LifecycleEvent(_Kind(kind), rid, group, index, rid, detail, ts))  # type: ignore[arg-type]

    def _attempt(
        self, rid: int, group: int, i: int, attempt: int, start: float, status: Status, *, last: bool
    ) -> float:
        """One attempt's events; returns when a retry would start."""
        rng = self.rng
        gen0 = start + rng.random() * 0.2
        self._emit("attempt_start", rid, group, i, start, {"attempt": attempt})
        self._emit("gen_start", rid, group, i, gen0, {"attempt": attempt})
        cursor = self._turns(rid, group, i, attempt, gen0) if self.agentic else gen0
        gen1 = cursor + 0.1 + rng.random() * 0.4
        state = status.value if last else "failed"
        self._emit("gen_end", rid, group, i, gen1, {"status": state, "response_tokens": 12})
        if self.unfinished_every and i % self.unfinished_every == 0 and last:
            return gen1
        end = gen1 + rng.random() * 0.01
        detail: dict = {"attempt": attempt, "status": state}
        if not last:
            detail.update(error="RuntimeError", message="engine connection reset")
        self._emit("attempt_end", rid, group, i, end, detail)
        return end + 0.01

    def _turns(self, rid: int, group: int, i: int, attempt: int, gen0: float) -> float:
        """Two agentic turns with a tool call each (`turn_*`, `tool_*` events); returns their end."""
        rng, cursor = self.rng, gen0
        for turn in range(2):
            self._emit("turn_start", rid, group, i, cursor, {"attempt": attempt, "turn": turn})
            tool = cursor + 0.05 + rng.random() * 0.05
            dur = 0.02 + rng.random() * 0.05
            self._emit("tool_start", rid, group, i, tool, {"attempt": attempt, "name": "calc"})
            end = {"attempt": attempt, "name": "calc", "duration_s": dur, "status": "ok"}
            self._emit("tool_end", rid, group, i, tool + dur, end)
            cursor = tool + dur + 0.02
            self._emit(
                "turn_end",
                rid,
                group,
                i,
                cursor,
                {"attempt": attempt, "turn": turn, "duration_s": cursor - gen0},
            )
        return cursor

    def _record(self, rid: int, group: int, i: int, status: Status, attempts: int) -> float:
        """The sample's `samples.jsonl` line (and its full trajectory when recorded); its reward."""
        rng = self.rng
        reward = {"score": round(rng.random(), 3), "format": 1.0} if i % 7 == 0 else round(rng.random(), 3)
        scalar = reward["score"] if isinstance(reward, dict) else reward
        failed = status in (Status.FAILED, Status.ABORTED)
        full = i < self.trajectories_per_step or failed
        pad = self.trajectory_tokens if full else 0
        sample = _sample(rng, rid, i, group, status, reward, attempts - 1, agentic=self.multi, pad=pad)
        advantage = round(scalar - 0.5, 4)
        record = sample_record(sample, step=rid + 1, rollout_id=rid, split="train")
        record["advantage"] = None if failed else advantage
        self.samples.write(json.dumps(record) + "\n")
        if full:
            n = sample.response_length
            detail = TokenDetail(
                None if failed else [advantage] * n,
                [
                    round(lp + 0.01 * _LOGPROBS[j % 97], 4)
                    for j, lp in enumerate(sample.rollout_logprobs or [])
                ]
                or None,
            )
            line = trajectory_record(
                sample, step=rid + 1, rollout_id=rid, split="train", reason=status.value if failed else "sampled",
                decode=decode, detail=detail,
            )  # fmt: skip
            write_lines(self.trajectories, [line])
        return scalar


def _metrics_row(rid: int, t: float, rewards: list[float], rng: random.Random) -> dict:
    return {
        "step": rid + 1,
        "time": t,
        "rollout/reward_mean": sum(rewards) / len(rewards),
        "train/loss": rng.random(),
        "time/rollout_s": 0.6,
        "time/train_s": 0.3,
        "time/sync_s": 0.1,
        "time/step_s": 1.0,
    }


def write_synthetic_run(
    root: str | Path,
    *,
    steps: int,
    samples_per_step: int,
    group_size: int = 8,
    agentic: bool = False,
    retry_every: int = 0,
    unfinished_every: int = 0,
    state: str = "finished",
    total_steps: int | None = None,
    seed: int = 0,
    t_start: float = 1_800_000_000.0,
    trajectories_per_step: int = 4,
    trajectory_tokens: int = 0,
    tool_turns: bool | None = None,
) -> Path:
    """Write `steps` steps of `samples_per_step` samples (4 events each, more when `agentic`).

    `retry_every=k`: every k-th sample fails its first attempt and succeeds on a retry;
    `unfinished_every=k`: every k-th sample's attempt has no `attempt_end`;
    `trajectories_per_step`: full trajectories (`trajectories.jsonl`) of the first samples of each
    step, plus every failed or aborted one (multi-turn with a tool observation when `agentic`);
    `trajectory_tokens`: those recorded samples' last turn is padded to about this many tokens;
    `tool_turns`: samples hold a tool call and its observation (default: `agentic`).
    """
    rng = random.Random(seed)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    total = total_steps if total_steps is not None else steps
    (root / "config.toml").write_text(
        f'[run]\nname = "{root.name}"\nnum_steps = {total}\n\n[rollout]\nn_samples_per_prompt = {group_size}\n',
        encoding="utf-8",
    )
    sink = JsonlSink(root / "lifecycle.jsonl")
    with (
        (root / "metrics.jsonl").open("w", encoding="utf-8") as metrics,
        (root / SAMPLES_FILE).open("w", encoding="utf-8") as samples,
        (root / TRAJECTORIES_FILE).open("w", encoding="utf-8") as trajectories,
    ):
        writer = _StepWriter(
            rng, sink, samples, trajectories, group_size, agentic, agentic if tool_turns is None else tool_turns,
            retry_every, unfinished_every, trajectories_per_step, trajectory_tokens,
        )  # fmt: skip
        for rid in range(steps):
            step_t0 = t_start + rid * 1.0
            rewards = writer.step(rid, step_t0, samples_per_step)
            metrics.write(json.dumps(_metrics_row(rid, step_t0 + 1.0, rewards, rng)) + "\n")
    sink.close()
    status = {
        "state": state,
        "phase": "done" if state != "running" else "rollout",
        "step": steps,
        "total_steps": total,
        "phase_seconds": {"rollout": 0.6 * steps, "train": 0.3 * steps, "sync": 0.1 * steps},
        "eta_s": float(total - steps) if state == "running" else None,
    }
    (root / STATUS_FILE).write_text(json.dumps(status), encoding="utf-8")
    return root
