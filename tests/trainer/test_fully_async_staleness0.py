"""Fully-async rollout with `max_weight_staleness = 0` is synchronous training: with the same
seeds and config it trains on the same batches and ends with the same weights as
`rollout.fully_async = false` (the embedded engine, the real trainer, several steps)."""

from __future__ import annotations

import torch
from train_testlib import install_reward_module, run_dict, write_prompts

from verst.trainer.config import run_config_from_dict
from verst.trainer.run.controller import InMemoryLogger, Trainer


def _train(tmp_path, name, reward, data, model, **rollout):
    cfg = run_config_from_dict(
        run_dict(
            model,
            data,
            run={"num_steps": 3, "save_interval": 0},
            rollout={"reward": {"type": reward}, "batch_size": 2, **rollout},
        )
    )
    logger = InMemoryLogger()
    trainer = Trainer(cfg, tmp_path / name, env={}, logger=logger)
    try:
        summary = trainer.run()
        weights = {k: v.detach().clone() for k, v in trainer.train.state_dict_for_sync().items()}
    finally:
        trainer.close()
    return cfg, summary, weights, logger


def test_fully_async_at_staleness_0_is_synchronous_training(tmp_path, tiny_checkpoint, monkeypatch):
    torch.set_num_threads(1)
    reward = install_reward_module(tmp_path, monkeypatch)
    data = write_prompts(tmp_path / "prompts.jsonl", n=9)
    _, sync, sync_w, sync_log = _train(tmp_path, "sync", reward, data, tiny_checkpoint)
    cfg, fa, fa_w, fa_log = _train(
        tmp_path, "async0", reward, data, tiny_checkpoint, fully_async=True, max_weight_staleness=0
    )
    assert cfg.algorithm.tis is False, "staleness 0 is on-policy: the TIS default stays off"
    assert fa.prompts == sync.prompts and len(fa.prompts) == 3, "the same batches, in the same order"
    for key in ("rollout/reward_mean", "rollout/response_length_mean", "train/loss"):
        a = [m.get(key) for _, m in sync_log.records]
        b = [m.get(key) for _, m in fa_log.records]
        assert a == b or all(x == y or abs(x - y) < 1e-6 for x, y in zip(a, b, strict=True)), key
    assert sync_w.keys() == fa_w.keys()
    for k in sync_w:
        torch.testing.assert_close(fa_w[k], sync_w[k], rtol=0, atol=1e-6, msg=k)
    assert sync_log.records[-1][1]["weight_version"] == 3.0, "three steps, three weight syncs"
