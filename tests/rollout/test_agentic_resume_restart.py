"""`on_abort = "resume"` across a process restart (issue 25, item 17): a parked environment lives
in the process's memory only, so an episode resubmitted after a restart (its sample restored
from the checkpoint's data-source buffer, with its turns) cannot continue. It restarts from its
prompt, and that is counted — `rollout/env/resumes_lost` — never silent (docs/agentic.md).

The restart is the real sequence: the first strategy's data-source state (what the checkpoint
holds) is loaded into a second strategy built from scratch, as a resumed run does.
"""

from __future__ import annotations

import asyncio

from agentic_testkit import ScriptEngine
from test_agentic_rollout import SleepyEnv, _strategy

from verst.rollout.protocols import RolloutRequest
from verst.rollout.sample import Status


def _build(engine):
    return _strategy(
        engine,
        lambda: SleepyEnv(0.0, turns=3),
        prompts=["p0:", "p1:"],
        batch_size=1,
        over_sampling_batch_size=2,
        env={"on_abort": "resume"},
        partial_rollout=True,
    )


def test_an_episode_parked_before_a_restart_restarts_and_is_counted():
    def delay(conv: str, request) -> float:
        return 5.0 if conv.startswith("p1:") and "[obs" in conv else 0.0

    engine = ScriptEngine(lambda c, r: "abcdefgh", delay_s=delay)
    strategy, ctx = _build(engine)
    asyncio.run(strategy(RolloutRequest(0)))
    (back,) = ctx.data_source.buffer
    assert back[0].status is Status.ABORTED and back[0].response == "abcdefgh[obs 1]abcd"
    saved = ctx.data_source.state_dict()  # what the checkpoint keeps

    engine.delay_s = 0.0
    restarted, ctx2 = _build(engine)  # a new process: nothing is parked
    ctx2.data_source.load_state_dict(saved)
    result = asyncio.run(restarted(RolloutRequest(1)))
    s = result.groups[0][0]
    assert s.prompt == "p1:" and s.status is Status.COMPLETED
    assert s.response == "abcdefgh[obs 1]abcdefgh[obs 2]abcdefgh"  # from its prompt, not the cut turn
    assert s.metadata["env_metrics"]["resumes_lost"] == 1.0
    assert result.metrics["rollout/env/resumes_lost"] == 1.0


def test_an_episode_resumed_in_the_same_process_is_not_counted_lost():
    def delay(conv: str, request) -> float:
        return 5.0 if conv.startswith("p1:") and "[obs" in conv else 0.0

    engine = ScriptEngine(lambda c, r: "abcdefgh", delay_s=delay)
    strategy, _ = _build(engine)
    asyncio.run(strategy(RolloutRequest(0)))
    engine.delay_s = 0.0
    result = asyncio.run(strategy(RolloutRequest(1)))
    s = result.groups[0][0]
    assert s.response.startswith("abcdefgh[obs 1]abcd")  # continued
    assert "resumes_lost" not in s.metadata["env_metrics"]
    assert "rollout/env/resumes_lost" not in result.metrics
