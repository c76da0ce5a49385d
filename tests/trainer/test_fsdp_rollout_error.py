"""A `RolloutError` on rank 0 of a 2-process FSDP run stops every rank with the error within
seconds (issue 25, item 14). Rank 0's failure travels in the broadcast that would have carried
the rollout's groups, so rank 1 does not wait for groups that never come; both then checkpoint
together (the same collectives) and raise.

Two real processes (forked, gloo on loopback, FSDP2 on CPU), the real loop: the reward function
always raises, so rank 0's rollout ends in `RolloutFailedError` after its failure streak.
Slow (about 2 min on 2 loaded cores: two processes load the model and build FSDP): `uv run pytest
-m slow tests/trainer/test_fsdp_rollout_error.py`. Before the fix both ranks hung (rank 0 in the
checkpoint's collective, rank 1 in the groups' broadcast).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch
from train_testlib import run_dict, write_prompts

from verst.rollout.engines.sglang.launcher import free_port


def broken_reward(sample) -> float:
    raise ValueError("this reward always fails")


def _worker(rank: int, port: int, cfg_dict: dict, run_dir: str, out: str) -> None:
    from verst.trainer.config import run_config_from_dict
    from verst.trainer.run.controller import run_training

    torch.set_num_threads(1)
    env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    os.environ.update(env)
    report = {"rank": rank}
    try:
        run_training(run_config_from_dict(cfg_dict), run_dir, env=env)
        report["error"] = None
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["is_rollout_error"] = (
            type(exc).__module__.startswith("verst.") and "Rollout" in type(exc).__name__
        )
    report["ended"] = time.time()
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_rollout_error_on_rank_0_stops_every_rank(tmp_path, tiny_checkpoint):
    data = write_prompts(tmp_path / "prompts.jsonl", 16)
    cfg = run_dict(
        tiny_checkpoint,
        data,
        run={"num_steps": 2, "save_interval": 0},
        train={"fsdp": True},
        rollout={"reward": {"type": f"{__name__}:broken_reward"}, "max_group_retries": 0},
    )
    ctx = mp.get_context("fork")
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, port, cfg, str(tmp_path / "run"), str(tmp_path)))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} never exited after rank 0's RolloutError"
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["error"] and r0["error"].startswith("RolloutFailedError"), r0
    assert r1["error"] and "rank 0's rollout failed" in r1["error"] and r1["is_rollout_error"], r1
    assert abs(r1["ended"] - r0["ended"]) < 30, "the ranks did not stop together"
