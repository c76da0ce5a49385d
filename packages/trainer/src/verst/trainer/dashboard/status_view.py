"""Run state helpers for `RunData.status`: is a pid alive, total wall time, phase seconds, last rewards."""

from __future__ import annotations

import os
import time
from typing import Any

CONFIG_SUMMARY_KEYS = (
    "run.name",
    "run.num_steps",
    "run.placement",
    "train.model_path",
    "train.lr",
    "train.micro_batch_size",
    "train.fsdp",
    "algorithm.advantage",
    "algorithm.policy_loss",
    "algorithm.loss_agg",
    "algorithm.kl_coef",
    "rollout.batch_size",
    "rollout.n_samples_per_prompt",
    "rollout.max_response_len",
    "rollout.temperature",
    "rollout.strategy",
    "engine.type",
    "engine.model_path",
)
"""Config fields shown first in the overview (those present; the whole config is there too)."""


def pid_alive(pid: int) -> bool:
    """A process with this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wall_seconds(status: dict[str, Any], state: str, metrics: list[dict[str, Any]]) -> float | None:
    """Seconds from the start to the last update (to now while running)."""
    started, updated = status.get("started_at"), status.get("updated_at")
    if isinstance(started, int | float):
        end = time.time() if state == "running" else updated
        if isinstance(end, int | float):
            return round(max(0.0, end - started), 3)
    times = [m["time"] for m in metrics if isinstance(m.get("time"), int | float)]
    return round(times[-1] - times[0], 3) if len(times) > 1 else None


def last_rewards(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """The last logged value of every reward metric (rollout and eval), with its step."""
    out: dict[str, Any] = {}
    for m in metrics:
        for k, v in m.items():
            if "reward" in k and isinstance(v, int | float) and not isinstance(v, bool):
                out[k] = {"step": m["step"], "value": v}
    return out


def metric_phases(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds per phase summed from the time/<phase>_s metrics (runs without status.json)."""
    out: dict[str, float] = {}
    for m in metrics:
        for phase in ("rollout", "train", "sync"):
            value = m.get(f"time/{phase}_s")
            if isinstance(value, int | float):
                out[phase] = out.get(phase, 0.0) + value
    return {k: round(v, 3) for k, v in out.items()}
