"""A 2-step run with run.placement='ray' (2 FSDP train actors on CPU bundles + the rollout
manager) produces what the same run does in one process: the same metrics, checkpoints and
lifecycle events, the same rewards, and the same trained weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from ray_testlib import install_reward_module, ray_run, run_actors_left, run_dict, write_prompts
from safetensors.torch import load_file

from verst.trainer.checkpoint import latest_checkpoint, read_meta
from verst.trainer.config import run_config_from_dict
from verst.trainer.controller import InMemoryLogger, run_training


def _volatile(key: str) -> bool:
    return "time" in key or key.endswith("per_s")  # wall-clock timings and throughputs differ


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    out: dict[str, torch.Tensor] = {}
    for f in sorted((ckpt / "model").glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_ray_placement_matches_local_run(ray_cluster, tmp_path, tiny_checkpoint, monkeypatch):
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
    local_log, ray_log = InMemoryLogger(), InMemoryLogger()
    local = run_training(local_cfg, tmp_path / "local", env={}, logger=local_log)
    remote = run_training(ray_cfg, tmp_path / "ray", env={}, logger=ray_log)

    assert remote.steps_done == local.steps_done == 2
    assert remote.weight_version == local.weight_version == 2
    assert remote.prompts == local.prompts
    # the same metrics, step by step; rewards equal (same seeds, same weights at each rollout)
    assert [s for s, _ in ray_log.records] == [s for s, _ in local_log.records]
    for (_, lm), (_, rm) in zip(local_log.records, ray_log.records, strict=True):
        assert set(rm) == set(lm)
        for key in lm:
            if _volatile(key):
                continue
            assert abs(rm[key] - lm[key]) <= 1e-4 * max(1.0, abs(lm[key])), key
    assert ray_log.phases == local_log.phases
    # the same checkpoints (the ray one written by train rank 0 and the driver)
    assert read_meta(remote.checkpoint)["step"] == 2 and read_meta(remote.checkpoint)["weight_version"] == 2
    w_local, w_ray = _weights(tmp_path / "local"), _weights(tmp_path / "ray")
    assert w_local.keys() == w_ray.keys()
    for k in w_local:
        torch.testing.assert_close(w_ray[k], w_local[k], rtol=1e-4, atol=1e-5)
    # lifecycle events came from the rollout manager; each actor left its log in the run dir
    events = [json.loads(line) for line in (tmp_path / "ray" / "lifecycle.jsonl").read_text().splitlines()]
    assert events and {e["kind"] for e in events} >= {"attempt_start", "attempt_end"}
    for name in ("train-0", "train-1", "rollout"):
        log = (tmp_path / "ray" / "logs" / "actors" / f"{name}.log").read_text()
        assert f"{name} started" in log
    # nothing of the run is left on the cluster
    assert run_actors_left(ray_cluster) == []
