"""Slow: the rollout manager killed during a rollout surfaces the same way as a train rank (killed
in test_ray_train_run.py). `uv run pytest -m slow tests/ray` runs both; .ci/run does, after the
default suite."""

from __future__ import annotations

import pytest
import torch
from ray_testlib import (
    KillDuringStep,
    install_reward_module,
    ray_run,
    run_actors_left,
    run_dict,
    write_prompts,
)

from verst.trainer.config import run_config_from_dict
from verst.trainer.placement.proxies import ActorDiedError
from verst.trainer.run.controller import run_training


@pytest.mark.slow
def test_killed_rollout_manager_is_named(ray_cluster, tmp_path, tiny_checkpoint, monkeypatch):
    torch.set_num_threads(1)
    reward = install_reward_module(tmp_path, monkeypatch)
    data = write_prompts(tmp_path / "prompts.jsonl")
    cfg = run_config_from_dict(
        run_dict(tiny_checkpoint, data, reward, run=ray_run(num_train_actors=1, layout="disaggregated"))
    )
    killer = KillDuringStep(ray_cluster, "-rollout", at=2, phase="rollout")
    with pytest.raises(ActorDiedError) as info:
        run_training(cfg, tmp_path / "run", env={}, logger=killer)
    err = info.value
    assert err.actor == "rollout" and err.method == "rollout"
    assert "rollout manager, disaggregated" in str(err)
    assert any("rollout 0: 2 groups" in line for line in err.log_lines)  # step 1's rollout
    assert run_actors_left(ray_cluster) == []
    resumed = run_training(cfg, tmp_path / "run", env={})
    assert resumed.start_step == 1 and resumed.steps_done == 2
