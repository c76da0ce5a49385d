"""Shared helpers of the trainer tests (test_train_*.py): data files, a reward, run configs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import run_testlib


def write_prompts(path: Path, n: int = 24) -> Path:
    """A JSONL file of n addition prompts with labels."""
    return run_testlib.write_prompts(path, n)


def install_reward_module(tmp_path: Path, monkeypatch: Any) -> str:
    """The shared reward module, installed under this folder's own module name."""
    return run_testlib.install_reward_module(tmp_path, monkeypatch, "e2_test_rewards")


def run_dict(model: Path, data: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """A small run config (as a dict) on the tiny checkpoint; `sections` update each table."""
    base: dict[str, Any] = {
        "run": {"num_steps": 2, "seed": 0},
        "engine": {"type": "embedded", "device": "cpu", "max_batch_size": 64},
        "train": {"model_path": str(model), "lr": 1e-3, "micro_batch_size": 4, "num_threads": 1},
        "rollout": {
            "batch_size": 2,
            "n_samples_per_prompt": 4,
            "max_response_len": 6,
            "seed": 7,
            "data": {"path": str(data), "seed": 3},
        },
        "algorithm": {},
    }
    for name, update in sections.items():
        base.setdefault(name, {}).update(update)
    return base
