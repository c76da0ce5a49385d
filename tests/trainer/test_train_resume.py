"""Resume determinism, and SIGTERM → finish the step, checkpoint, exit cleanly.

N steps straight vs N/2 steps, a SIGTERM, then a resumed run of the rest: the same prompts in
the same order and the same weights within float tolerance.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
from safetensors.torch import load_file
from train_testlib import install_reward_module, run_dict, write_prompts

from verst.trainer.config import run_config_from_dict
from verst.trainer.run.checkpoint import latest_checkpoint, read_meta
from verst.trainer.run.controller import InMemoryLogger, run_training


class SigtermAt(InMemoryLogger):
    """Sends a real SIGTERM to this process once step `at` is logged."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def log(self, step, metrics):
        super().log(step, metrics)
        if step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    out = {}
    for f in sorted((ckpt / "model").glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_resume_matches_straight_run(tmp_path, tiny_checkpoint, monkeypatch):
    torch.set_num_threads(1)
    reward = install_reward_module(tmp_path, monkeypatch)
    data = write_prompts(tmp_path / "prompts.jsonl", n=5)  # 4 steps x 2 groups cross an epoch boundary
    cfg = run_config_from_dict(
        run_dict(
            tiny_checkpoint,
            data,
            run={"num_steps": 4, "save_interval": 0},
            rollout={
                "reward": {"type": reward},
                "eval": {"interval": 3, "datasets": {"held": {"path": str(data)}}},
            },
            train={"lr": 1e-3},
        )
    )

    straight = run_training(cfg, tmp_path / "straight", env={})
    assert straight.steps_done == 4 and straight.weight_version == 4 and not straight.stopped_early

    handler_before = signal.getsignal(signal.SIGTERM)  # SIG_DFL, or Ray's if a Ray test ran first
    logger = SigtermAt(2)
    first = run_training(cfg, tmp_path / "resumed", env={}, logger=logger)
    assert first.stopped_early and first.steps_done == 2
    assert read_meta(first.checkpoint)["step"] == 2 and read_meta(first.checkpoint)["weight_version"] == 2
    assert signal.getsignal(signal.SIGTERM) is handler_before  # handlers restored
    second = run_training(cfg, tmp_path / "resumed", env={})
    assert second.start_step == 2 and second.steps_done == 4 and second.weight_version == 4

    assert first.prompts + second.prompts == straight.prompts
    # eval at the start, every 3 steps, and at the end (not repeated after a resume)
    assert [s for s, _ in straight.eval_history] == [0, 3, 4]
    assert [s for s, _ in first.eval_history] + [s for s, _ in second.eval_history] == [0, 3, 4]
    assert "eval/held/reward_mean" in straight.eval_history[-1][1]
    assert len({p for step in straight.prompts for p in step}) == 5  # an epoch boundary was crossed
    # the run learned something (non-zero advantages), so equal weights are not trivially equal
    assert any(abs(m.get("train/advantage_abs_mean", 0.0)) > 0 for _, m in logger.records)
    w_straight, w_resumed = _weights(tmp_path / "straight"), _weights(tmp_path / "resumed")
    initial = load_file(next((tiny_checkpoint).glob("*.safetensors")))
    assert w_straight.keys() == w_resumed.keys()
    moved = 0.0
    for k in w_straight:
        torch.testing.assert_close(w_resumed[k], w_straight[k], rtol=1e-5, atol=1e-6)
        moved = max(moved, float((w_straight[k] - initial[k]).abs().max()))
    assert moved > 1e-4
    # lifecycle events and the metrics of every step
    assert (tmp_path / "resumed" / "lifecycle.jsonl").stat().st_size > 0
    steps = [s for s, m in logger.records if "train/loss" in m]
    assert steps == [1, 2]
    for step, m in logger.records:
        if "train/loss" in m:
            assert "train/logprob_mismatch" in m
            # every sample records the weight version it was generated with (synced after each step)
            assert m["train/sample_weight_version_min"] == m["train/sample_weight_version_max"] == step - 1
            assert m["weight_version"] == step
