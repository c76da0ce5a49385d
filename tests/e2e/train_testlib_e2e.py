"""A small run config on the tiny checkpoint for the e2e fault tests (sections update the base)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import run_testlib

from verst.trainer.config import RunConfig, run_config_from_dict


def run_config(tmp_path: Path, model: Path, monkeypatch: Any, **sections: dict[str, Any]) -> RunConfig:
    reward = run_testlib.install_reward_module(tmp_path, monkeypatch, "e2e_fault_rewards")
    data = run_testlib.write_prompts(tmp_path / "prompts.jsonl", 24)
    base: dict[str, Any] = {
        "run": {"num_steps": 2, "seed": 0, "save_interval": 0},
        "engine": {"type": "embedded", "device": "cpu", "max_batch_size": 64},
        "train": {"model_path": str(model), "lr": 1e-3, "micro_batch_size": 4, "num_threads": 1},
        "rollout": {
            "batch_size": 2,
            "n_samples_per_prompt": 2,
            "max_response_len": 4,
            "seed": 7,
            "data": {"path": str(data), "seed": 3},
            "reward": {"type": reward},
        },
    }
    for name, update in sections.items():
        base.setdefault(name, {}).update(update)
    if base["engine"]["type"] != "embedded":
        base["engine"] = {k: v for k, v in base["engine"].items() if k not in ("device", "max_batch_size")}
    return run_config_from_dict(base)
