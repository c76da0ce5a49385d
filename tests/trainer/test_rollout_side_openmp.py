"""The trainer's thread hands its OpenMP workers back while it waits on the rollout side
(`verst.rollout.openmp`): during a synchronous rollout the engine's kernels run with the only
worker team in the process (the engine's own release: `tests/engines/test_openmp_release.py`).
Real runtime threads in `/proc/self/task`, a team's workers told apart by name (`openmp_testlib`)."""

from __future__ import annotations

import torch
from openmp_testlib import parallel_kernel, requires_libgomp, tids
from run_testlib import install_reward_module, write_prompts

from verst.rollout.openmp import release_openmp_workers

pytestmark = requires_libgomp


def test_the_trainer_thread_releases_its_workers_while_it_waits(tmp_path, tiny_checkpoint, monkeypatch):
    from verst.trainer.config import run_config_from_dict
    from verst.trainer.run.rollout_side import RolloutSide

    reward = install_reward_module(tmp_path, monkeypatch, "omp_rewards")
    data = write_prompts(tmp_path / "prompts.jsonl", 8)
    cfg = run_config_from_dict({
        "engine": {"type": "embedded", "device": "cpu", "max_batch_size": 8},
        "rollout": {"batch_size": 2, "n_samples_per_prompt": 2, "max_response_len": 4,
                    "data": {"path": str(data)}, "reward": {"type": reward}},
    })  # fmt: skip
    before = torch.get_num_threads()
    side = RolloutSide(cfg, model_path=str(tiny_checkpoint), env={})
    torch.set_num_threads(2)
    try:
        release_openmp_workers()
        team = parallel_kernel()
        assert len(team) == 1  # this thread's team: one worker
        side.state_dict()
        assert not team & tids(), "released before waiting on the loop"
        team = parallel_kernel()
        assert len(team) == 1
        result = side.rollout(0, 0, stop=lambda: False)
        assert len(result.groups) == 2
        assert not team & tids(), "released before waiting on the rollout"
    finally:
        side.close()
        torch.set_num_threads(before)
