"""A run with run.placement='ray' (2 FSDP train actors on CPU bundles + the rollout manager):

1. rank 1 is `ray.kill`ed as step 2 enters its train phase — rank 0 is then blocked in a
   collective waiting for it, so the call must fail on rank 1's death (not hang): the error names
   the actor and quotes its last log lines, and nothing of the run is left on the cluster;
2. running again resumes from the step-1 checkpoint and finishes, and shuts down cleanly: no
   actor logs an ERROR, the rollout manager closes its side, every attempt's events are written;
3. the result is what the same run gives in one process: the same prompts, metrics, rewards,
   checkpoints and trained weights (the Ray run and the resume are both checked against it).

One test covers the three, so the suite starts each actor process once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ray_testlib import (
    KillDuringStep,
    install_reward_module,
    log_sizes,
    ray_run,
    run_actors_left,
    run_dict,
    shutdown_problems,
    write_prompts,
)
from safetensors.torch import load_file

from verst.trainer.config import run_config_from_dict
from verst.trainer.placement.proxies import ActorDiedError
from verst.trainer.run.checkpoint import latest_checkpoint, read_meta
from verst.trainer.run.controller import InMemoryLogger, run_training


def _volatile(key: str) -> bool:
    return "time" in key or key.endswith("per_s")  # wall-clock timings and throughputs differ


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    out: dict[str, torch.Tensor] = {}
    for f in sorted((ckpt / "model").glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.slow  # ~90 s on 2 cores: .ci/run runs tests/ray's slow tests after the default suite
def test_ray_run_survives_killed_rank_and_matches_local(ray_cluster, tmp_path, tiny_checkpoint, monkeypatch):
    torch.set_num_threads(1)
    reward = install_reward_module(tmp_path, monkeypatch)
    data = write_prompts(tmp_path / "prompts.jsonl")
    local_cfg = run_config_from_dict(run_dict(tiny_checkpoint, data, reward))
    ray_cfg = run_config_from_dict(
        run_dict(
            tiny_checkpoint,
            data,
            reward,
            run=ray_run(num_train_actors=2, layout="colocated"),
            train={"fsdp": True},
        )
    )
    local_log = InMemoryLogger()
    local = run_training(local_cfg, tmp_path / "local", env={}, logger=local_log)
    assert local.steps_done == 2

    # 1. a train rank dies during step 2
    run_dir = tmp_path / "ray"
    killer = KillDuringStep(ray_cluster, "-train-1", at=2, phase="train")
    with pytest.raises(ActorDiedError) as info:
        run_training(ray_cfg, run_dir, env={}, logger=killer)
    err = info.value
    message = str(err)
    assert killer.killed and err.actor == "train-1" and err.method == "train_step"
    assert "'train-1'" in message and "died during train_step" in message and killer.killed in message
    assert "train rank 1 of 2" in message
    assert err.log_lines and any("train_step" in line for line in err.log_lines)  # step 1's work
    assert all(line in message for line in err.log_lines)
    assert "step_1" in message  # the checkpoint to resume from
    assert run_actors_left(ray_cluster) == []  # every actor of the run was ended
    assert [s for s, m in killer.records if "train/loss" in m] == [1]

    # 2. running again resumes from step 1, and ends cleanly (no ERROR lines, the rollout side
    # closed, every attempt's events written)
    resumed_log = InMemoryLogger()
    before = log_sizes(run_dir)
    resumed = run_training(ray_cfg, run_dir, env={}, logger=resumed_log)
    assert shutdown_problems(run_dir, since=before) == []
    assert resumed.start_step == 1 and resumed.steps_done == 2 and resumed.weight_version == 2
    assert "resumed_from" in (run_dir / "resume.log").read_text()
    assert read_meta(resumed.checkpoint)["step"] == 2 and read_meta(resumed.checkpoint)["weight_version"] == 2
    assert run_actors_left(ray_cluster) == []

    # 3. ... and equals the one-process run
    assert resumed.prompts == local.prompts[1:]
    ray_records = killer.records + resumed_log.records
    assert [s for s, _ in ray_records] == [s for s, _ in local_log.records]
    for (_, lm), (_, rm) in zip(local_log.records, ray_records, strict=True):
        assert set(rm) == set(lm)
        for key in lm:
            if not _volatile(key):
                assert abs(rm[key] - lm[key]) <= 1e-4 * max(1.0, abs(lm[key])), key
    w_local, w_ray = _weights(tmp_path / "local"), _weights(run_dir)
    assert w_local.keys() == w_ray.keys()
    for k in w_local:
        torch.testing.assert_close(w_ray[k], w_local[k], rtol=1e-4, atol=1e-5)

    # lifecycle events came from the rollout manager, relayed by the driver into its run dir
    # (the same events as the local run's; step 2's rollout ran twice: before the kill and after);
    # samples.jsonl (written by the driver) holds the same samples and rewards
    def lines(root, name):
        return [json.loads(line) for line in (root / name).read_text().splitlines()]

    events = lines(run_dir, "lifecycle.jsonl")
    assert {e["kind"] for e in events} >= {"attempt_start", "attempt_end"}

    def event_key(e):
        return (e["rollout_id"], e["kind"], e["group_index"], e["sample_index"])

    assert {event_key(e) for e in events} == {
        event_key(e) for e in lines(tmp_path / "local", "lifecycle.jsonl")
    }

    def sample_key(s):
        return (s["step"], s["split"], s["sample_index"], s["status"], round(s["reward"], 6))

    ray_samples = {sample_key(s) for s in lines(run_dir, "samples.jsonl")}
    assert ray_samples == {sample_key(s) for s in lines(tmp_path / "local", "samples.jsonl")}

    # the advantages and full trajectories the driver recorded come from rank 0 of the train actors
    def advantages(root):
        return {
            (s["step"], s["split"], s["sample_index"]): s["advantage"] for s in lines(root, "samples.jsonl")
        }

    ray_adv, local_adv = advantages(run_dir), advantages(tmp_path / "local")
    assert ray_adv.keys() == local_adv.keys() and any(v is not None for v in ray_adv.values())
    for k, v in ray_adv.items():
        assert (v is None) == (local_adv[k] is None) and (v is None or abs(v - local_adv[k]) < 1e-4), k
    from verst.trainer.dashboard.trajectories import read_trajectories

    ray_traj = {(t["step"], t["split"], t["sample_index"]): t for t in read_trajectories(run_dir)}
    local_traj = {
        (t["step"], t["split"], t["sample_index"]): t for t in read_trajectories(tmp_path / "local")
    }
    assert ray_traj.keys() == local_traj.keys() and ray_traj
    for k, t in ray_traj.items():
        assert t["tokens"] == local_traj[k]["tokens"] and t["loss_mask"] == local_traj[k]["loss_mask"]
        if k[1] == "train":
            assert t["advantages"] == pytest.approx(local_traj[k]["advantages"], abs=1e-4)
    assert any(t["trainer_logprobs"] is not None for t in ray_traj.values())  # rank 0's rows
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"
    for name in ("train-0", "train-1", "rollout"):
        assert f"{name} started" in (run_dir / "logs" / "actors" / f"{name}.log").read_text()
