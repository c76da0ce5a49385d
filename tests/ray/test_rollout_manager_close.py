"""The rollout manager's `close_side` — what every `run.placement=ray` run calls at its end —
closes the side for real (issue 25, item 25: it raised `AttributeError: ... '_resume'`, which the
driver swallowed, so the strategy never handed its unfinished groups back and its last events
were never drained).

`RolloutManagerActor` is a plain class (`RayPlacement` makes it remote), so this runs it in this
process, no cluster needed: a fully-async strategy keeps generating after its rollout returns,
and closing must hand every group in flight or buffered back to the data source and return the
events emitted while closing. The cluster-level check is `ray_testlib.shutdown_problems`, which
the Ray end-to-end tests assert after their runs.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from ray_testlib import install_reward_module, run_dict, write_prompts

from verst.trainer.config import run_config_from_dict
from verst.trainer.placement.actors import RolloutManagerActor, RolloutStopped


@pytest.fixture
def actor_logging():
    """The actor adds handlers to the root logger (in its own process, that is its whole life)."""
    before = list(logging.getLogger().handlers)
    yield
    for handler in logging.getLogger().handlers:
        if handler not in before:
            logging.getLogger().removeHandler(handler)
            handler.close()


def test_close_side_closes_the_strategy_and_returns_its_last_events(
    tmp_path, tiny_checkpoint, monkeypatch, actor_logging
):
    torch.set_num_threads(1)
    reward = install_reward_module(tmp_path, monkeypatch)
    data = write_prompts(tmp_path / "prompts.jsonl")
    rollout = {"fully_async": True, "max_response_len": 24}
    cfg = run_config_from_dict(run_dict(tiny_checkpoint, data, reward, rollout=rollout))
    actor = RolloutManagerActor("rollout", cfg, {}, str(tmp_path / "run"), log_lines=200, sys_path=[])
    actor.setup(str(tiny_checkpoint), colocated=True)
    result, _ = actor.call("rollout", 0, 0)
    assert len(result.groups) == cfg.rollout.batch_size
    relayed = actor.drain_events()
    events, _ = actor.call("close_side", True)  # the producer was still generating
    log = "\n".join(actor.log_tail())
    assert " ERROR " not in log, log
    assert "close_side: done" in log
    assert actor.side._loop.is_closed()  # the side's loop (and so the strategy) is closed
    returned = actor.side.data_source.num_buffered_groups
    assert returned > 0, "the groups in play were not handed back to the data source"
    started = {
        (e.rollout_id, e.group_index, e.sample_index, e.detail.get("attempt"))
        for e in relayed + events
        if e.kind == "attempt_start"
    }
    ended = {
        (e.rollout_id, e.group_index, e.sample_index, e.detail.get("attempt"))
        for e in relayed + events
        if e.kind == "attempt_end"
    }
    assert started and started <= ended, "attempts started before the close never ended"
    actor.close(True)  # the driver's final close after close_side is harmless


HANGING_REWARD = """
import asyncio


async def never(sample):
    await asyncio.sleep(600)
    return 0.0
"""


def test_interrupt_stops_a_running_rollout_and_hands_its_groups_back(
    tmp_path, tiny_checkpoint, monkeypatch, actor_logging
):
    """Issue 25, item 15 (the actor half; the driver half is `test_ray_stop_mid_rollout.py`):
    `interrupt` (Ray runs it in the control group, beside the rollout; here from another thread)
    ends a rollout that cannot end by itself within seconds, as a `RolloutStopped` value (an
    exception would tear the placement down), with its groups back in the data source and no
    ERROR line. Before: the rollout manager had no way to stop a running rollout."""
    torch.set_num_threads(1)
    (tmp_path / "hanging_reward.py").write_text(HANGING_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = write_prompts(tmp_path / "prompts.jsonl")
    cfg = run_config_from_dict(run_dict(tiny_checkpoint, data, "hanging_reward:never"))
    actor = RolloutManagerActor("rollout", cfg, {}, str(tmp_path / "run"), log_lines=200, sys_path=[])
    actor.setup(str(tiny_checkpoint), colocated=False)
    box: list = []
    worker = threading.Thread(target=lambda: box.append(actor.call("rollout", 3, 0)[0]))
    worker.start()
    time.sleep(1.0)  # the rollout is waiting for its rewards
    assert worker.is_alive(), "the rollout ended by itself"
    actor.interrupt(2)  # another rollout's id stops nothing
    time.sleep(0.5)
    assert worker.is_alive(), "an interrupt for another rollout stopped this one"
    asked = time.monotonic()
    actor.interrupt(3)
    worker.join(30)
    assert not worker.is_alive() and time.monotonic() - asked < 10, "the rollout did not stop"
    (result,) = box
    assert isinstance(result, RolloutStopped) and "stopped" in result.message
    assert actor.side.data_source.num_buffered_groups == cfg.rollout.batch_size, "groups not handed back"
    log = "\n".join(actor.log_tail())
    assert " ERROR " not in log and "rollout 3: stopped" in log, log
    actor.close(True)
