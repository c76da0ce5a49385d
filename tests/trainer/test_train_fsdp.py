"""FSDP on CPU: 2 processes over gloo really shard, and train like 1 process.

accelerate ignores its FSDP plugin on CPU; verst shards with FSDP2 `fully_shard` directly. The
workers are real processes (forked, one torch thread each, rendezvous over TCP on loopback:
`fsdp_testlib.TwoRanks`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fsdp_testlib import TwoRanks

from verst.rollout.engines.sglang.launcher import free_port
from verst.rollout.toy import toy_groups
from verst.trainer.algorithms import AlgorithmConfig
from verst.trainer.config import TrainConfig
from verst.trainer.train.batch import build_train_batch
from verst.trainer.train.fsdp import DistInfo
from verst.trainer.train.model import build_policy
from verst.trainer.train.side import TrainSide

STEPS = 2


def _groups(vocab: int) -> list:
    """The FSDP tests' scored groups (test_lora_fsdp, test_train_lr_schedule and test_train_metrics
    import them too)."""
    return toy_groups(vocab, seed=3)


def _config(model: str, fsdp: bool) -> TrainConfig:
    # eps=1: the AdamW step is ~linear in small gradients, so weights compare the gradients
    return TrainConfig(model_path=model, fsdp=fsdp, micro_batch_size=2, lr=0.5, eps=1.0, num_threads=1)


def _train(model: str, env: dict[str, str], fsdp: bool) -> tuple[TrainSide, list[dict[str, float]]]:
    side = TrainSide(
        _config(model, fsdp),
        AlgorithmConfig(),
        model_path=model,
        total_steps=STEPS,
        max_response_len=5,
        temperature=1.0,
        env=env,
    )
    batch = build_train_batch(_groups(side.bundle.hf_model.config.vocab_size))
    return side, [side.train_step(batch) for _ in range(STEPS)]


def _worker(env: dict[str, str], model: str, out: str) -> dict:
    from verst.trainer.train.fsdp import is_sharded

    side, metrics = _train(model, env, fsdp=True)
    shards = {
        n: (p.to_local().numel(), p.numel(), is_sharded(p)) for n, p in side.bundle.module.named_parameters()
    }
    weights = side.state_dict_for_sync()  # a collective: full weights on rank 0
    side.save(Path(out) / "ckpt")  # a collective too; rank 0 writes
    return {"shards": shards, "metrics": metrics, "weights": weights, "sharding": side.bundle.sharding}


def test_two_process_cpu_fsdp_shards_and_matches_one_process(tmp_path, tiny_checkpoint):
    torch.set_num_threads(1)
    ranks = TwoRanks(_worker, str(tiny_checkpoint), str(tmp_path), out=tmp_path)
    # the 1-process reference trains while the workers run
    single = TrainSide(
        _config(str(tiny_checkpoint), False),
        AlgorithmConfig(),
        model_path=str(tiny_checkpoint),
        total_steps=STEPS,
        max_response_len=5,
        temperature=1.0,
        env={},
    )
    batch = build_train_batch(_groups(single.bundle.hf_model.config.vocab_size))
    ref_metrics = [single.train_step(batch) for _ in range(STEPS)]
    ref = single.state_dict_for_sync()
    r0, r1 = ranks.results()

    assert r0["sharding"] == "fsdp2-direct"
    # every parameter is a DTensor split across the two ranks (large ones really sharded)
    for name, (local0, full, sharded) in r0["shards"].items():
        local1 = r1["shards"][name][0]
        assert local0 + local1 == full, name
        if full >= 2:
            assert sharded and local0 < full, f"{name} is not sharded"
    assert r1["weights"] == {}  # full weights are gathered to rank 0 only

    assert r0["weights"].keys() == ref.keys()
    for k, v in ref.items():
        torch.testing.assert_close(r0["weights"][k], v, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    for m_fsdp, m_ref in zip(r0["metrics"], ref_metrics, strict=True):
        assert m_fsdp["train/grad_norm"] == pytest.approx(m_ref["train/grad_norm"], rel=1e-4)
        assert m_fsdp["train/loss"] == pytest.approx(m_ref["train/loss"], rel=1e-4, abs=1e-7)

    # the FSDP checkpoint (gathered full state) loads into a 1-process model: same weights
    single.load(tmp_path / "ckpt")
    for k, v in single.state_dict_for_sync().items():
        torch.testing.assert_close(v, r0["weights"][k])


def test_fsdp_on_cpu_with_one_process_is_refused(tiny_checkpoint):
    with pytest.raises(RuntimeError, match="unsharded"):
        build_policy(
            _config(str(tiny_checkpoint), True), str(tiny_checkpoint), total_steps=1, dist_info=DistInfo()
        )


TORCHRUN_SCRIPT = """
import os, sys
import torch
torch.set_num_threads(1)
from pathlib import Path
sys.path.insert(0, {testroot!r})  # run_testlib, which train_testlib imports
sys.path.insert(0, {testdir!r})
sys.path.insert(0, {rewarddir!r})
from train_testlib import run_dict
from verst.rollout.selection import resolve_extra_env_vars
from verst.trainer.config import run_config_from_dict
from verst.trainer.run.controller import run_training
cfg = run_config_from_dict(run_dict(
    Path({model!r}), Path({data!r}),
    run={{"num_steps": int(sys.argv[2]), "save_interval": 2}},
    train={{"fsdp": True}},
    rollout={{"reward": {{"type": {reward!r}}}}},
))
summary = run_training(cfg, sys.argv[1], env=resolve_extra_env_vars(cfg.run.env))
print("RANK", os.environ["RANK"], "steps", summary.steps_done, "version", summary.weight_version, flush=True)
import torch.distributed as dist
dist.destroy_process_group()
os._exit(0)
"""


@pytest.mark.slow
def test_torchrun_fsdp_training_run_and_resume(tmp_path, tiny_checkpoint, monkeypatch):
    """The whole loop under torchrun (2 CPU ranks, FSDP2): rank 0 rolls out, both train, resume."""
    import subprocess
    import sys

    from train_testlib import install_reward_module, write_prompts

    reward = install_reward_module(tmp_path, monkeypatch)
    data = write_prompts(tmp_path / "p.jsonl", n=5)
    script = tmp_path / "run.py"
    script.write_text(
        TORCHRUN_SCRIPT.format(
            testroot=str(Path(__file__).parents[1]),
            testdir=str(Path(__file__).parent),
            rewarddir=str(tmp_path),
            model=str(tiny_checkpoint),
            data=str(data),
            reward=reward,
        )
    )
    run_dir = tmp_path / "run"
    for steps in (2, 3):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(script),
            str(run_dir),
            str(steps),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert f"RANK 0 steps {steps} version {steps}" in out.stdout
        assert f"RANK 1 steps {steps} version {steps}" in out.stdout
    assert (run_dir / "checkpoints" / "step_3" / "meta.json").is_file()
    assert "step_2" in (run_dir / "resume.log").read_text()
