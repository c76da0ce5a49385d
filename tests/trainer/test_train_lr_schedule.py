"""The lr schedule advances once per optimizer step, whatever the number of processes.

accelerate's `AcceleratedScheduler` (what `accelerator.prepare(..., scheduler)` returns) steps
the wrapped scheduler once per process per optimizer step when batches are not split: with 2
ranks warm-up ended twice as fast. The test runs the real accelerate path (DDP over gloo) in 2
CPU processes — forked like the FSDP test's workers, each given the torchrun variables as its
environment — and compares each step's lr with the 1-process schedule.
"""

from __future__ import annotations

import os

import pytest
from fsdp_testlib import TwoRanks
from test_train_fsdp import _groups

from verst.trainer.algorithms import AlgorithmConfig
from verst.trainer.config import TrainConfig
from verst.trainer.train.batch import build_train_batch
from verst.trainer.train.optim import lr_lambda
from verst.trainer.train.side import TrainSide

STEPS, TOTAL = 3, 10
CFG = {"lr": 1.0, "warmup_steps": 4, "scheduler": "cosine", "min_lr_ratio": 0.1}


def _worker(env: dict[str, str], model: str) -> dict:
    from accelerate.state import AcceleratorState

    env = {**env, "LOCAL_WORLD_SIZE": "2"}
    os.environ.update(env)  # what torchrun gives each rank (accelerate reads os.environ itself)
    AcceleratorState._reset_state(reset_partial_state=True)  # the parent's 1-process state, forked
    cfg = TrainConfig(model_path=model, micro_batch_size=2, num_threads=1, **CFG)
    side = TrainSide(
        cfg,
        AlgorithmConfig(),
        model_path=model,
        total_steps=TOTAL,
        max_response_len=5,
        temperature=1.0,
        env=env,
    )
    batch = build_train_batch(_groups(side.bundle.hf_model.config.vocab_size))
    lrs = [side.train_step(batch)["train/lr"] for _ in range(STEPS)]
    return {
        "sharding": side.bundle.sharding,
        "world": side.bundle.accelerator.num_processes,
        "lrs": lrs,
        "last_epoch": side.bundle.raw_scheduler().last_epoch,
    }


def test_lr_schedule_steps_once_per_optimizer_step_with_two_accelerate_processes(tmp_path, tiny_checkpoint):
    results = TwoRanks(_worker, str(tiny_checkpoint), out=tmp_path).results()
    fn = lr_lambda(TrainConfig(**CFG), TOTAL)
    expected = [CFG["lr"] * fn(step) for step in range(STEPS)]  # the 1-process schedule
    for rank, r in enumerate(results):
        assert r["sharding"] == "none" and r["world"] == 2, r  # the accelerate (DDP) path, 2 ranks
        assert r["lrs"] == pytest.approx(expected, rel=1e-9), f"rank {rank}: {r['lrs']} != {expected}"
        assert r["last_epoch"] == STEPS, f"rank {rank} stepped its scheduler {r['last_epoch']} times"
