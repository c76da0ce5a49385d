"""Fully-async rollout with real parts: the embedded engine on the tiny model, the trainer's
background event loop (the producer generates while the trainer trains), the run-config rules
(TIS on by default, legacy flag refused), and the buffer in a checkpoint.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from inference_testkit import assert_attempts_closed, make_context
from run_testlib import install_reward_module, write_prompts

from verst.rollout.errors import ConfigError
from verst.rollout.protocols import RolloutRequest
from verst.rollout.selection import resolve_extra_env_vars
from verst.rollout.strategies.fully_async import FullyAsyncRollout
from verst.rollout.strategies.fully_async_options import fully_async_options
from verst.rollout.validation import FULLY_ASYNC_LEGACY_MESSAGE


def run_dict(model, data, **rollout):
    return {
        "run": {"num_steps": 3, "seed": 0, "save_interval": 2, "resume": False},
        "engine": {"type": "embedded", "device": "cpu", "max_batch_size": 64, "num_threads": 1},
        "train": {"model_path": str(model), "lr": 1e-3, "micro_batch_size": 8, "num_threads": 1},
        "rollout": {
            "batch_size": 2,
            "n_samples_per_prompt": 4,
            "max_response_len": 6,
            "seed": 7,
            "data": {"path": str(data), "seed": 3},
            "reward": {"type": "g1_fa_rewards:digit_fraction"},
            **rollout,
        },
        "algorithm": {},
    }


# ---------------------------------------------------------------- config rules


def test_tis_is_on_by_default_for_fully_async_unless_set_explicitly():
    from verst.trainer.config import run_config_from_dict

    assert run_config_from_dict({"rollout": {"fully_async": True}}).algorithm.tis is True
    assert run_config_from_dict({}).algorithm.tis is False
    explicit = {"rollout": {"fully_async": True}, "algorithm": {"tis": False}}
    assert run_config_from_dict(explicit).algorithm.tis is False
    as_old = {"rollout": {"fully_async": True}, "algorithm": {"use_rollout_logprobs_as_old": True}}
    assert run_config_from_dict(as_old).algorithm.tis is False
    resolved = run_config_from_dict({"rollout": {"fully_async": True}})
    assert run_config_from_dict(resolved.model_dump()).algorithm.tis is True


@pytest.mark.parametrize("where", ["ambient", "config"])
def test_fully_async_with_the_legacy_flag_fails_fast_in_run_validation(where, tiny_checkpoint):
    from verst.trainer.config import run_config_from_dict, validate_run_config

    cfg_dict = {"rollout": {"fully_async": True}, "train": {"model_path": str(tiny_checkpoint)}}
    ambient = {"VERST_USE_LEGACY_ROLLOUT_V1": "1"} if where == "ambient" else {}
    if where == "config":
        cfg_dict["run"] = {"env": {"VERST_USE_LEGACY_ROLLOUT_V1": "1"}}
    cfg = run_config_from_dict(cfg_dict)
    env = resolve_extra_env_vars(cfg.run.env, ambient)
    with pytest.raises(ConfigError) as info:
        validate_run_config(cfg, env, cuda_available=False)
    assert any(FULLY_ASYNC_LEGACY_MESSAGE in p.why for p in info.value.problems)
    validate_run_config(cfg, resolve_extra_env_vars({}, {}), cuda_available=False)  # fine without it


# ---------------------------------------------------------------- the embedded engine


@pytest.mark.timeout(120)
async def test_producer_on_the_embedded_engine_records_weight_versions(tiny_checkpoint):
    import torch

    from verst.rollout.engines.embedded.engine import EmbeddedEngine

    torch.set_num_threads(1)
    engine = EmbeddedEngine.from_pretrained(tiny_checkpoint, device="cpu")
    try:
        ctx = make_context(
            engine,
            prompts=[f"{i}+{i}=" for i in range(40)],
            fully_async=True,
            batch_size=2,
            n_samples_per_prompt=2,
            async_buffer_groups=4,
            max_response_len=6,
            max_weight_staleness=1,
            seed=3,
        )
        ctx.tokenizer = engine.tokenizer
        strategy = FullyAsyncRollout(ctx)
        r0 = await strategy(RolloutRequest(rollout_id=0, weight_version=0))
        trained = [g[0].metadata["prompt_id"] for g in r0.groups]
        assert all(s.weight_versions == [0] for g in r0.groups for s in g)
        weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
        # weight updates land while the producer is generating
        for version in (1, 2, 3):
            assert await engine.update_weights_from_tensors(weights, weight_version=version) == version
            r = await strategy(RolloutRequest(rollout_id=version, weight_version=version))
            assert len(r.groups) == 2
            trained += [g[0].metadata["prompt_id"] for g in r.groups]
            for s in (s for g in r.groups for s in g):
                s.validate()
                assert s.status.is_finished and len(s.rollout_logprobs) == s.response_length
                assert version - min(s.weight_versions) <= 1
            assert r.metrics["rollout/staleness_max"] <= 1
        await strategy.close()
        assert_attempts_closed(ctx.sink)
        ds = ctx.data_source
        assert engine.load() == {"num_running_reqs": 0, "num_waiting_reqs": 0}
        back = [g[0].metadata["prompt_id"] for g in ds.buffer]
        assert sorted(trained + back) == list(range(ds.offset)), "trained or handed back, once each"
    finally:
        await engine.close()


# ---------------------------------------------------------------- the trainer


@pytest.mark.timeout(240)
def test_fully_async_training_run_overlaps_and_checkpoints_the_buffer(tmp_path, tiny_checkpoint, monkeypatch):
    import torch

    from verst.trainer.config import run_config_from_dict
    from verst.trainer.run.controller import InMemoryLogger, run_training

    install_reward_module(tmp_path, monkeypatch, "g1_fa_rewards")
    data = write_prompts(tmp_path / "prompts.jsonl", 24)
    cfg = run_config_from_dict(run_dict(tiny_checkpoint, data, fully_async=True, async_buffer_groups=4))
    assert cfg.algorithm.tis

    produced_during_training: list[int] = []
    at_train_start = [0]
    # Pace the producer so that it has work left when a train step begins: group i may start
    # generating once the trainer has begun i // batch_size train steps (without this, the tiny
    # model's 6-token groups could refill the buffer before the trainer reaches "train", leaving
    # nothing to produce then). Starting is paced, finishing is not.
    batch = cfg.rollout.batch_size
    train_steps_begun = [0]

    class Spy(InMemoryLogger):
        def phase(self, name):
            super().phase(name)
            if name == "train":
                strategy = trainer_strategy[0]
                at_train_start[0] = strategy.produced_groups
                train_steps_begun[0] += 1
                # the trainer's thread is held here, outside any rollout call: only a producer
                # running in its own thread can finish a group now
                deadline = time.monotonic() + 30
                while strategy.produced_groups == at_train_start[0] and time.monotonic() < deadline:
                    time.sleep(0.01)
            if name == "sync":  # the train step just ran: did the producer keep generating?
                produced_during_training.append(trainer_strategy[0].produced_groups - at_train_start[0])

    trainer_strategy: list[FullyAsyncRollout] = []
    from verst.trainer.run import rollout_side

    original = rollout_side.load_rollout_strategy

    def capture(path, context):
        strategy = original(path, context)
        trainer_strategy.append(strategy)
        generate, started = strategy._generate_with_retries, [0]

        async def paced(group):
            index, started[0] = started[0], started[0] + 1
            while index >= batch * (train_steps_begun[0] + 1) and not strategy._closing:
                await asyncio.sleep(0.005)
            return await generate(group)

        strategy._generate_with_retries = paced
        return strategy

    monkeypatch.setattr(rollout_side, "load_rollout_strategy", capture)
    logger = Spy()
    summary = run_training(cfg, tmp_path / "run", env={}, logger=logger)
    assert summary.steps_done == 3
    (strategy,) = trainer_strategy
    assert isinstance(strategy, FullyAsyncRollout)
    # groups finish only while the rollout side's loop runs: between calls, in its own thread
    assert len(produced_during_training) == 3
    assert all(n > 0 for n in produced_during_training), (
        f"the producer generated while the trainer trained: {produced_during_training}"
    )
    steps = [m for _, m in logger.records if "rollout/buffer_size" in m]
    assert len(steps) == 3
    for m in steps:
        assert (
            m["rollout/staleness_max"]
            <= fully_async_options(cfg.rollout.strategy_options).max_weight_staleness
        )
        # the off-policy correction is on and its mismatch is reported every step
        assert "train/logprob_mismatch" in m and "train/tis_weight_mean" in m
    assert not any(t.name == "verst-rollout-loop" and t.is_alive() for t in threading.enumerate())
    # the checkpoint holds the strategy's buffer (and prompts in flight)
    state = torch.load(summary.checkpoint / "run_state.pt", weights_only=False)
    saved = state["rollout"]["strategy"]
    assert saved["version"] == 1 and "buffer" in saved and "pending" in saved
    assert len(saved["buffer"]) + len(saved["pending"]) > 0
    assert summary.checkpoint.name.endswith("3")
    time.sleep(0)
