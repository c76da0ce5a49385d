"""The effective environment reaches every actor: with the legacy flag set in the driver's shell
(ambient) or in the config's run.env, the driver and every actor choose the same strategy, and
each actor's process environment (read by the test inside the actor) shows the same value."""

from __future__ import annotations

import os

import pytest
import torch
from ray_testlib import install_reward_module, ray_run, run_actors_left, run_dict, write_prompts

from verst.rollout.selection import (
    LEGACY_FLAG,
    LEGACY_STRATEGY_PATH,
    resolve_extra_env_vars,
    resolve_strategy_path,
)
from verst.trainer.config import run_config_from_dict, validate_run_config
from verst.trainer.placement import build_ray_placement
from verst.trainer.placement.proxies import ActorDiedError


def _fail(actor) -> None:
    """Runs inside an actor: a failure like a collective losing its peer."""
    raise RuntimeError("Connection closed by peer")


def _flag_in_process(actor, flag: str) -> str | None:
    """Runs inside an actor: what its process environment says."""
    return os.environ.get(flag)


# both sources end in the same `resolve_extra_env_vars` mapping that the actors get; the run.env
# source costs another ~30 s of actor starts, so it runs with tests/ray's slow tests in .ci/run
@pytest.mark.parametrize("source", ["ambient", pytest.param("config", marks=pytest.mark.slow)])
def test_legacy_flag_reaches_every_actor(ray_cluster, tmp_path, tiny_checkpoint, monkeypatch, source):
    torch.set_num_threads(1)
    reward = install_reward_module(tmp_path, monkeypatch)
    data = write_prompts(tmp_path / "prompts.jsonl")
    run = ray_run(num_train_actors=1, layout="disaggregated")
    if source == "ambient":
        monkeypatch.setenv(LEGACY_FLAG, "1")
    else:
        run["env"] = {LEGACY_FLAG: "true"}
    cfg = run_config_from_dict(run_dict(tiny_checkpoint, data, reward, run=run))
    env = resolve_extra_env_vars(cfg.run.env)  # the entry point's one mapping
    validate_run_config(cfg, env)
    driver_choice = resolve_strategy_path(cfg.rollout, env)
    assert driver_choice == LEGACY_STRATEGY_PATH

    placement = build_ray_placement(cfg, tmp_path / "run", model_path=str(tiny_checkpoint), env=env)
    try:
        actors = placement.actors
        assert [a.name for a in actors] == ["train-0", "rollout"]
        described = placement.call(actors, "describe")
        assert [d["strategy_path"] for d in described] == [driver_choice] * len(actors)
        # the rollout manager really built the legacy strategy from its environment
        assert placement.rollout.strategy_path == driver_choice
        assert placement.rollout.info["strategy_class"].endswith(":LegacyRolloutStrategy")
        expected = env[LEGACY_FLAG]
        seen = ray_cluster.get([a.handle.apply.remote(_flag_in_process, LEGACY_FLAG) for a in actors])
        assert seen == [expected] * len(actors)
        # and it generates through the legacy path inside the actor
        result = placement.rollout.rollout(0, 0)
        assert len(result.groups) == cfg.rollout.batch_size
        # fault: one actor dies while its peer's call fails (as a rank does when a collective
        # loses its peer); the error names the dead actor, the cause, whichever arrives first
        train, rollout = actors
        ray_cluster.kill(rollout.handle)
        with pytest.raises(ActorDiedError) as info:
            placement.call_each([(train, "apply", (_fail,)), (rollout, "apply", (_flag_in_process, "X"))])
        assert info.value.actor == "rollout" and "rollout manager" in str(info.value)
        assert placement.closed and run_actors_left(ray_cluster) == []
    finally:
        placement.close()
    assert placement.closed
