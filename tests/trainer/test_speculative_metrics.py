"""A training run with `engine.speculative` logs its acceptance metrics with every step (what
`verst train` writes to metrics.jsonl; the dashboard's Curves tab plots every logged metric by prefix: `rollout/speculative/*`), and the
trainer's log-probs match the engine's as with plain decoding (the draft never reaches them)."""

from __future__ import annotations

import torch
from train_testlib import install_reward_module, run_dict, write_prompts

from verst.rollout.engines.embedded.speculative.metrics import speculative_metrics
from verst.trainer.config import run_config_from_dict
from verst.trainer.run.controller import InMemoryLogger, run_training


def test_speculative_run_logs_acceptance_metrics(tmp_path, tiny_checkpoint, monkeypatch):
    torch.set_num_threads(1)
    reward = install_reward_module(tmp_path, monkeypatch)
    data = write_prompts(tmp_path / "prompts.jsonl", n=4)
    cfg = run_config_from_dict(
        run_dict(
            tiny_checkpoint,
            data,
            run={"num_steps": 2, "save_interval": 0},
            engine={"type": "embedded", "device": "cpu", "speculative": {"type": "ngram", "min_ngram": 1}},
            rollout={"reward": {"type": reward}, "max_response_len": 16},
        )
    )
    logger = InMemoryLogger()
    run_training(cfg, tmp_path / "run", env={}, logger=logger)
    rows = [metrics for _, metrics in logger.records]
    assert len(rows) == 2
    for row in rows:
        assert 0 <= row["rollout/speculative/acceptance_rate"] <= 1
        assert row["rollout/speculative/accepted_len"] >= 1
        assert abs(row["train/logprob_mismatch"]) < 1e-4


def test_metrics_are_the_interval_difference():
    before = {"steps": 2.0, "plain_steps": 1.0, "rows": 4.0, "proposed": 10.0, "accepted": 5.0, "emitted": 9.0}
    after = {"steps": 4.0, "plain_steps": 3.0, "rows": 8.0, "proposed": 18.0, "accepted": 11.0, "emitted": 19.0}
    m = speculative_metrics(before, after)
    assert m["rollout/speculative/acceptance_rate"] == 6 / 8
    assert m["rollout/speculative/accepted_len"] == (6 + 4) / 4
    assert m["rollout/speculative/plain_step_fraction"] == 2 / 4
    assert m["rollout/speculative/speculated_fraction"] == 2 / 4
    gated = speculative_metrics({**before, "gated": 0.0}, {**after, "gated": 1.0})
    assert gated["rollout/speculative/gated_fraction"] == 1 / 4
    assert speculative_metrics(None, None) == {}
