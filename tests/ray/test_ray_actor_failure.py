"""An actor killed mid-run surfaces as an error naming it and quoting its last log lines; the
placement is torn down; running again resumes from the last checkpoint and finishes.

Rank 1 of two FSDP train actors is killed as step 2 enters its train phase: rank 0 is then
blocked in a collective waiting for it, so the call must fail on rank 1's death rather than wait
for rank 0 (which would hang until gloo's timeout)."""

from __future__ import annotations

import pytest
import torch
from ray_testlib import install_reward_module, ray_run, run_actors_left, run_dict, write_prompts

from verst.trainer.checkpoint import read_meta
from verst.trainer.config import run_config_from_dict
from verst.trainer.controller import InMemoryLogger, run_training
from verst.trainer.placement.proxies import ActorDiedError


class KillDuringStep(InMemoryLogger):
    """`ray.kill`s the named actor when step `at` enters `phase`."""

    def __init__(self, ray, suffix: str, at: int, phase: str) -> None:
        super().__init__()
        self.ray, self.suffix, self.at, self.phase_name = ray, suffix, at, phase
        self.seen = 0
        self.killed: str | None = None

    def phase(self, name: str) -> None:
        super().phase(name)
        if name != self.phase_name:
            return
        self.seen += 1
        if self.seen == self.at:
            names = [a for a in self.ray.util.list_named_actors(all_namespaces=True)]
            (target,) = [a for a in names if a["name"].endswith(self.suffix)]
            self.ray.kill(self.ray.get_actor(target["name"], namespace=target["namespace"]))
            self.killed = target["name"]


def test_killed_train_actor_is_named_and_run_resumes(ray_cluster, tmp_path, tiny_checkpoint, monkeypatch):
    torch.set_num_threads(1)
    reward = install_reward_module(tmp_path, monkeypatch)
    data = write_prompts(tmp_path / "prompts.jsonl")
    cfg = run_config_from_dict(
        run_dict(
            tiny_checkpoint,
            data,
            reward,
            run=ray_run(num_train_actors=2, layout="colocated"),
            train={"fsdp": True},
        )
    )
    run_dir = tmp_path / "run"
    killer = KillDuringStep(ray_cluster, "-train-1", at=2, phase="train")
    with pytest.raises(ActorDiedError) as info:
        run_training(cfg, run_dir, env={}, logger=killer)
    err = info.value
    message = str(err)
    assert killer.killed and err.actor == "train-1" and err.method == "train_step"
    assert "'train-1'" in message and "died during train_step" in message and killer.killed in message
    # its last log lines are quoted: the previous step's work is there
    assert err.log_lines and any("train_step" in line for line in err.log_lines)
    assert all(line in message for line in err.log_lines)
    assert "step_1" in message  # the checkpoint to resume from is named
    # the whole placement was torn down: no actor of the run is left
    assert run_actors_left(ray_cluster) == []
    assert [s for s, m in killer.records if "train/loss" in m] == [1]

    resumed = run_training(cfg, run_dir, env={})
    assert resumed.start_step == 1 and resumed.steps_done == 2 and resumed.weight_version == 2
    assert read_meta(resumed.checkpoint)["step"] == 2
    assert "resumed_from" in (run_dir / "resume.log").read_text()
