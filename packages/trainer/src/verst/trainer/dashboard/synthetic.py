"""A synthetic run directory in the formats a real run writes (for the load benchmark and tests).

Lines come from the real writers' code (`LifecycleEvent.to_dict`, `recording.sample_record`,
the metrics row layout), so the synthetic files cannot drift from what a run writes. Options add
agentic sub-spans (`turn_*` / `tool_*` events with durations), retries, failures and unfinished
attempts, so every timeline feature can be exercised without a long run.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from verst.rollout.lifecycle import JsonlSink, LifecycleEvent
from verst.rollout.sample import Sample, Status
from verst.trainer.run.recording import SAMPLES_FILE, STATUS_FILE, sample_record

_STATUSES = (Status.COMPLETED, Status.TRUNCATED, Status.ABORTED, Status.FAILED)


class _Kind(str):
    """An event kind that need not be an `EventKind` member (agentic kinds such as `turn_start`)."""

    @property
    def value(self) -> str:
        return str(self)


def _event(kind: str, rid: int, group: int, index: int, ts: float, detail: dict) -> LifecycleEvent:
    return LifecycleEvent(_Kind(kind), rid, group, index, rid, detail, ts)  # type: ignore[arg-type]


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
) -> Path:
    """Write `steps` steps of `samples_per_step` samples (4 events each, more when `agentic`).

    `retry_every=k`: every k-th sample fails its first attempt and succeeds on a retry;
    `unfinished_every=k`: every k-th sample's attempt has no `attempt_end`.
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
    t = t_start
    with (
        (root / "metrics.jsonl").open("w", encoding="utf-8") as metrics,
        (root / SAMPLES_FILE).open("w", encoding="utf-8") as samples,
    ):
        for rid in range(steps):
            step_t0 = t
            rewards = []
            for i in range(samples_per_step):
                group = i // group_size
                start = step_t0 + rng.random() * 0.05
                attempts = 2 if retry_every and i % retry_every == 0 else 1
                status = _STATUSES[0] if rng.random() < 0.85 else rng.choice(_STATUSES[1:])
                for attempt in range(attempts):
                    last = attempt == attempts - 1
                    gen0 = start + rng.random() * 0.2
                    sink.emit(_event("attempt_start", rid, group, i, start, {"attempt": attempt}))
                    sink.emit(_event("gen_start", rid, group, i, gen0, {"attempt": attempt}))
                    cursor = gen0
                    if agentic:
                        for turn in range(2):
                            sink.emit(
                                _event(
                                    "turn_start", rid, group, i, cursor, {"attempt": attempt, "turn": turn}
                                )
                            )
                            tool = cursor + 0.05 + rng.random() * 0.05
                            dur = 0.02 + rng.random() * 0.05
                            sink.emit(
                                _event(
                                    "tool_start", rid, group, i, tool, {"attempt": attempt, "name": "calc"}
                                )
                            )
                            sink.emit(
                                _event(
                                    "tool_end",
                                    rid,
                                    group,
                                    i,
                                    tool + dur,
                                    {"attempt": attempt, "name": "calc", "duration_s": dur, "status": "ok"},
                                )
                            )
                            cursor = tool + dur + 0.02
                            sink.emit(
                                _event(
                                    "turn_end",
                                    rid,
                                    group,
                                    i,
                                    cursor,
                                    {"attempt": attempt, "turn": turn, "duration_s": cursor - gen0},
                                )
                            )
                    gen1 = cursor + 0.1 + rng.random() * 0.4
                    ok = last
                    sink.emit(
                        _event(
                            "gen_end",
                            rid,
                            group,
                            i,
                            gen1,
                            {"status": status.value if ok else "failed", "response_tokens": 12},
                        )
                    )
                    if unfinished_every and i % unfinished_every == 0 and last:
                        break
                    end = gen1 + rng.random() * 0.01
                    detail = {"attempt": attempt, "status": status.value if ok else "failed"}
                    if not ok:
                        detail.update(error="RuntimeError", message="engine connection reset")
                    sink.emit(_event("attempt_end", rid, group, i, end, detail))
                    start = end + 0.01
                reward = (
                    {"score": round(rng.random(), 3), "format": 1.0} if i % 7 == 0 else round(rng.random(), 3)
                )
                rewards.append(reward["score"] if isinstance(reward, dict) else reward)
                sample = Sample(
                    prompt=f"What is {i} + {rid}? Think step by step.\nAnswer:",
                    label=str(i + rid),
                    tokens=list(range(40)),
                    response_length=24,
                    response=f"Let me add {i} and {rid}. " * 3 + f"The answer is {i + rid}.",
                    reward=reward,
                    status=status,
                    weight_versions=[rid],
                    metadata={"attempt": attempts - 1},
                    group_index=group,
                    sample_index=i,
                )
                if status is Status.FAILED:
                    sample.metadata["error"] = "reward: ValueError: could not parse the answer"
                samples.write(
                    json.dumps(sample_record(sample, step=rid + 1, rollout_id=rid, split="train")) + "\n"
                )
            t = step_t0 + 1.0
            row = {
                "step": rid + 1,
                "time": t,
                "rollout/reward_mean": sum(rewards) / len(rewards),
                "train/loss": rng.random(),
                "time/rollout_s": 0.6,
                "time/train_s": 0.3,
                "time/sync_s": 0.1,
                "time/step_s": 1.0,
            }
            metrics.write(json.dumps(row) + "\n")
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
