"""SIGTERM during a rollout on `run.placement=ray` stops the run within seconds (issue 25, item 15).

Real Ray (the session cluster), the real rollout manager actor and a real SIGTERM to this
process. Step 2's rollout cannot end by itself: its reward awaits for minutes (the first
rollout's 8 rewards return at once). The driver polls its stop request while it waits for the
rollout; the rollout manager's `interrupt` (its control concurrency group, beside the running
rollout) cancels it, the strategy hands the groups back, and the run checkpoints and closes
cleanly: no ERROR line in any actor log, the side closed, every attempt's events written.
Before this, the driver waited for the rollout to end (here: the reward's 10 minutes).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from ray_testlib import ray_run, run_actors_left, run_dict, shutdown_problems, write_prompts
from run_testlib import OnPhase

from verst.trainer.config import run_config_from_dict
from verst.trainer.run.checkpoint import latest_checkpoint
from verst.trainer.run.controller import run_training

SLOW_REWARD = '''
import asyncio

calls = 0


async def slow_after_first_rollout(sample):
    """Step 1's 8 rewards at once; from step 2 on each waits 10 minutes (in the rollout actor)."""
    global calls
    calls += 1
    if calls > 8:
        await asyncio.sleep(600)
    return float(len(sample.response) % 2)
'''


@pytest.mark.slow  # ~70 s under load (2 actor processes): .ci/run runs tests/ray's slow tests
@pytest.mark.timeout(240)
def test_sigterm_during_a_ray_rollout_stops_it_and_checkpoints_cleanly(
    ray_cluster, tmp_path, tiny_checkpoint, monkeypatch
):
    torch.set_num_threads(1)
    (tmp_path / "slow_ray_reward.py").write_text(SLOW_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = write_prompts(tmp_path / "prompts.jsonl")
    run = {**ray_run(num_train_actors=1), "num_steps": 3}
    cfg = run_config_from_dict(
        run_dict(tiny_checkpoint, data, "slow_ray_reward:slow_after_first_rollout", run=run)
    )
    logger = OnPhase("rollout", 1, lambda: os.kill(os.getpid(), signal.SIGTERM), delay_s=1.0)
    run_dir = tmp_path / "run"
    summary = run_training(cfg, run_dir, env={}, logger=logger)
    took = time.monotonic() - logger.fired_at
    assert took < 30, f"the run took {took:.1f} s to stop after SIGTERM: it waited for the rollout"
    assert summary.stopped_early and summary.steps_done == 1
    assert summary.checkpoint is not None and summary.checkpoint.name == "step_1"
    state = torch.load(latest_checkpoint(run_dir / "checkpoints") / "run_state.pt", weights_only=False)
    assert len(state["rollout"]["data_source"]["buffer"]) == 2, (
        "the stopped rollout's groups were handed back"
    )
    assert shutdown_problems(run_dir) == []
    rollout_log = (run_dir / "logs" / "actors" / "rollout.log").read_text()
    assert "interrupt: stopping rollout 1" in rollout_log and "rollout 1: stopped" in rollout_log
    assert run_actors_left(ray_cluster) == []
