"""Shared helpers of the trainer tests (test_train_*.py): data files, a reward, run configs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REWARD_MODULE = '''
def digit_fraction(sample):
    """Fraction of digit characters in the response: varies across samples of a tiny random model."""
    text = sample.response
    return sum(c.isdigit() for c in text) / max(1, len(text))
'''


def write_prompts(path: Path, n: int = 24) -> Path:
    """A JSONL file of n addition prompts with labels."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"prompt": f"{i}+{i + 1}=", "label": str(2 * i + 1)}) + "\n")
    return path


def install_reward_module(tmp_path: Path, monkeypatch: Any) -> str:
    """Write a reward module to `tmp_path`, put it on sys.path; returns its import path."""
    (tmp_path / "e2_test_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "e2_test_rewards:digit_fraction"


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
