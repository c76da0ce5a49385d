"""Helpers of the Ray placement tests: a prompt file, a reward module, a run config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import run_testlib


def write_prompts(path: Path, n: int = 16) -> Path:
    """A JSONL file of n addition prompts with labels."""
    return run_testlib.write_prompts(path, n)


def install_reward_module(tmp_path: Path, monkeypatch: Any) -> str:
    """The shared reward module, installed under this folder's own module name."""
    return run_testlib.install_reward_module(tmp_path, monkeypatch, "g2_ray_rewards")


def run_dict(model: Path, data: Path, reward: str, **sections: dict[str, Any]) -> dict[str, Any]:
    """A 2-step run on the tiny checkpoint; `sections` update each table."""
    base: dict[str, Any] = {
        "run": {"num_steps": 2, "seed": 0, "save_interval": 1},
        "engine": {"type": "embedded", "device": "cpu", "max_batch_size": 64, "num_threads": 1},
        "train": {"model_path": str(model), "lr": 1e-3, "micro_batch_size": 4, "num_threads": 1},
        "rollout": {
            "batch_size": 2,
            "n_samples_per_prompt": 4,
            "max_response_len": 6,
            "seed": 7,
            "data": {"path": str(data), "seed": 3},
            "reward": {"type": reward},
        },
        "algorithm": {},
    }
    for name, update in sections.items():
        base.setdefault(name, {}).update(update)
    return base


def ray_run(**ray: Any) -> dict[str, Any]:
    """A `run` table update for placement='ray' on CPU bundles."""
    return {"placement": "ray", "ray": {"device": "cpu", **ray}}


def run_actors_left(ray: Any, timeout_s: float = 30.0) -> list[str]:
    """Names of verst actors still alive once `ray.kill` has had up to `timeout_s` to land."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        left = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        left = [n for n in left if n.startswith("verst-")]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


class KillDuringStep:
    """A metrics logger that `ray.kill`s the actor whose name ends with `suffix` when the
    `at`-th `phase` begins (the driver is then about to call it for that step)."""

    def __init__(self, ray: Any, suffix: str, at: int, phase: str) -> None:
        from verst.trainer.run.controller import InMemoryLogger

        self._inner = InMemoryLogger()
        self.records = self._inner.records
        """(step, metrics) logged before the kill."""
        self.ray, self.suffix, self.at, self.phase_name = ray, suffix, at, phase
        self.seen = 0
        self.killed: str | None = None
        """The Ray name of the killed actor."""

    def log(self, step: int, metrics: Any) -> None:
        self._inner.log(step, metrics)

    def phase(self, name: str) -> None:
        self._inner.phase(name)
        if name != self.phase_name:
            return
        self.seen += 1
        if self.seen == self.at:
            named = self.ray.util.list_named_actors(all_namespaces=True)
            (target,) = [a for a in named if a["name"].endswith(self.suffix)]
            self.ray.kill(self.ray.get_actor(target["name"], namespace=target["namespace"]))
            self.killed = target["name"]

    def close(self) -> None:
        pass


def log_sizes(run_dir: Path) -> dict[str, int]:
    """Bytes in each actor log now (so a later check reads only what a new run appends)."""
    logs = run_dir / "logs" / "actors"
    return {p.name: p.stat().st_size for p in logs.glob("*.log")} if logs.is_dir() else {}


def shutdown_problems(run_dir: Path, since: dict[str, int] | None = None) -> list[str]:
    """What is wrong with how a `run.placement=ray` run ended (empty: a clean shutdown).

    Read from the run's own files, after `since` (`log_sizes` taken before the run): no actor
    logged an ERROR line; the rollout manager closed its side (`close_side: done`: the strategy
    handed unfinished samples back and its last events were drained); and every attempt in
    `lifecycle.jsonl` that started also ended (the events emitted while closing were written)."""
    import json

    since = since or {}
    problems: list[str] = []
    texts = {}
    for path in sorted((run_dir / "logs" / "actors").glob("*.log")):
        with path.open("rb") as fh:
            fh.seek(since.get(path.name, 0))
            texts[path.name] = fh.read().decode("utf-8", "replace")
    for name, text in texts.items():
        problems += [f"{name}: {line}" for line in text.splitlines() if " ERROR " in line]
    if "close_side: done" not in texts.get("rollout.log", ""):
        problems.append("rollout.log: the rollout manager never finished close_side")
    events = [json.loads(line) for line in (run_dir / "lifecycle.jsonl").read_text().splitlines() if line]

    def key(e: dict) -> tuple:
        return (e["rollout_id"], e["group_index"], e["sample_index"], e["detail"].get("attempt"))

    ended = {key(e) for e in events if e["kind"] == "attempt_end"}
    problems += [
        f"lifecycle.jsonl: attempt {key(e)} never ended"
        for e in events
        if e["kind"] == "attempt_start" and key(e) not in ended
    ]
    return problems
