"""`FullyAsyncRollout`: backpressure, staleness (retry/drop), nothing lost, checkpoint, close.

Deterministic in-test engine (`inference_testkit.ToyEngine`); the embedded-engine and trainer
paths are in `test_fully_async_engine.py`.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from inference_testkit import ListDataSource, ToyEngine, assert_attempts_closed, make_context

from verst.rollout.engine import GenerateOutput, GenerateRequest
from verst.rollout.protocols import Capability, RolloutRequest, RolloutStrategy
from verst.rollout.sample import Status
from verst.rollout.strategies.fully_async import FullyAsyncRollout, ProducerError


def pid(group):
    return group[0].metadata["prompt_id"]


async def settle(strategy: FullyAsyncRollout, timeout: float = 2.0) -> None:
    """Wait until the producer is idle (buffer full, or nothing left to generate)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        await asyncio.sleep(0.01)
        if not strategy._in_flight:
            await asyncio.sleep(0.01)
            if not strategy._in_flight:
                return
    raise AssertionError("producer did not settle")


def fully_async_context(engine=None, **config):
    return make_context(engine, fully_async=True, **{"async_buffer_groups": 4, **config})


async def test_capabilities_and_protocol():
    strategy = FullyAsyncRollout(fully_async_context())
    assert isinstance(strategy, RolloutStrategy)
    assert Capability.FULLY_ASYNC in strategy.capabilities
    assert strategy.capabilities == frozenset(Capability)
    await strategy.close()
    with pytest.raises(RuntimeError, match="closed"):
        await strategy(RolloutRequest(rollout_id=0))


async def test_buffer_too_small_for_a_batch_is_refused():
    with pytest.raises(ValueError, match="async_buffer_groups >= 3"):
        FullyAsyncRollout(fully_async_context(batch_size=3, async_buffer_groups=2))


async def test_backpressure_bounds_buffered_plus_in_flight():
    engine = ToyEngine(token_delay_s=0.001)
    ctx = fully_async_context(engine, batch_size=2, async_buffer_groups=5, over_sampling_batch_size=3)
    strategy = FullyAsyncRollout(ctx)
    served = []
    for step in range(4):
        result = await strategy(RolloutRequest(rollout_id=step))
        assert len(result.groups) == 2
        assert all(s.status.is_finished for g in result.groups for s in g)
        served.append(ctx.data_source.served_groups)
        await settle(strategy)  # "training": the producer runs until the buffer is full, then waits
        assert len(strategy.buffer) == 5
        assert ctx.data_source.served_groups == 2 * (step + 1) + 5, "the producer stopped at the bound"
        assert result.metrics["rollout/buffer_size"] <= 5
    assert strategy.peak_buffer == 5
    await strategy.close()
    assert_attempts_closed(ctx.sink)


async def test_overlap_next_batch_is_ready_without_waiting():
    engine = ToyEngine(token_delay_s=0.005)
    strategy = FullyAsyncRollout(fully_async_context(engine, batch_size=2, async_buffer_groups=4))
    first = await strategy(RolloutRequest(rollout_id=0))
    await settle(strategy)
    second = await strategy(RolloutRequest(rollout_id=1))
    # generated while "training": the second call only takes from the buffer
    assert second.metrics["rollout/wait_s"] < first.metrics["rollout/wait_s"]
    assert second.metrics["rollout/buffer_size"] == 2
    await strategy.close()


@pytest.mark.parametrize("policy", ["retry", "drop"])
async def test_stale_groups_are_retried_or_dropped_and_counted(policy):
    engine = ToyEngine()
    ctx = fully_async_context(
        engine, batch_size=2, async_buffer_groups=4, max_weight_staleness=1, stale_policy=policy
    )
    strategy = FullyAsyncRollout(ctx)
    r0 = await strategy(RolloutRequest(rollout_id=0, weight_version=0))
    await settle(strategy)
    buffered = sorted(pid(b.group) for b in strategy.buffer)
    assert len(buffered) == 4
    # weights move on by 2 versions: everything buffered (version 0) is too stale
    engine.weight_version = 2
    r1 = await strategy(RolloutRequest(rollout_id=1, weight_version=2))
    m = r1.metrics
    assert all(s.weight_versions == [2] for g in r1.groups for s in g)
    assert m["rollout/staleness_mean"] == 0.0
    if policy == "retry":
        assert m["rollout/stale_retried"] == 4 and m["rollout/stale_dropped"] == 0
        # the stale prompts were regenerated first (the data source serves hand-backs first)
        assert set(map(pid, r1.groups)) <= set(buffered)
    else:
        assert m["rollout/stale_dropped"] == 4 and m["rollout/stale_retried"] == 0
        assert sorted(pid(g) for g in strategy.last_dropped_groups) == buffered
        assert not set(map(pid, r1.groups)) & set(buffered)
    assert {pid(g) for g in r0.groups}.isdisjoint(buffered)
    await strategy.close()


async def test_groups_within_the_staleness_bound_are_kept_and_measured():
    engine = ToyEngine()
    strategy = FullyAsyncRollout(fully_async_context(engine, batch_size=2, max_weight_staleness=1))
    await strategy(RolloutRequest(rollout_id=0, weight_version=0))
    await settle(strategy)
    engine.weight_version = 1
    r1 = await strategy(RolloutRequest(rollout_id=1, weight_version=1))
    assert r1.metrics["rollout/stale_retried"] == 0
    assert r1.metrics["rollout/staleness_mean"] == 1.0 and r1.metrics["rollout/staleness_max"] == 1.0
    await strategy.close()


async def test_aborted_groups_are_handed_back_with_partial_tokens_and_resumed():
    # The engine aborts each prompt's first request halfway (as an engine that aborts requests to
    # update weights does); with partial_rollout the partial tokens are kept and resumed.
    class AbortOnce(ToyEngine):
        async def generate(self, request: GenerateRequest) -> GenerateOutput:
            out = await super().generate(request)
            if request.sampling.max_new_tokens == 6:  # a first request (resumes ask for fewer)
                half = len(out.output_ids) // 2
                return GenerateOutput(out.output_ids[:half], out.output_logprobs[:half], "abort", 0, 0)
            return out

    engine = AbortOnce(length=lambda r: 6)
    ctx = fully_async_context(
        engine,
        batch_size=2,
        n_samples_per_prompt=1,
        partial_rollout=True,
        mask_offpolicy_in_partial_rollout=True,
        max_response_len=6,
    )
    strategy = FullyAsyncRollout(ctx)
    r0 = await strategy(RolloutRequest(rollout_id=0))
    assert r0.metrics["rollout/aborted_retried"] >= 2
    resumed = [s for g in r0.groups for s in g]
    for s in resumed:
        s.validate()
        assert s.status.is_finished and s.response_length == 6
        assert len(s.weight_versions) == 2, "generated in two pieces"
        # the same rollout id resumed it: nothing is off-policy yet
        assert s.loss_mask is None
    await strategy.close()


async def test_aborted_groups_dropped_with_drop_policy():
    class AlwaysAbort(ToyEngine):
        async def generate(self, request: GenerateRequest) -> GenerateOutput:
            if sum(request.input_ids) % 3 == 0:
                return GenerateOutput([65], [-0.1], "abort", self.weight_version, 0)
            return await super().generate(request)

    ctx = fully_async_context(AlwaysAbort(), batch_size=2, n_samples_per_prompt=1, stale_policy="drop")
    strategy = FullyAsyncRollout(ctx)
    total_dropped = 0
    for step in range(3):
        r = await strategy(RolloutRequest(rollout_id=step))
        assert all(s.status.is_finished for g in r.groups for s in g)
        total_dropped += r.metrics["rollout/aborted_dropped"]
        assert len(strategy.last_dropped_groups) == r.metrics["rollout/aborted_dropped"]
    assert total_dropped > 0
    await strategy.close()


async def test_failing_groups_are_retried_then_failed_and_counted():
    def fail(req):
        return RuntimeError("engine down") if sum(req.input_ids) % 4 == 1 else None

    ctx = fully_async_context(ToyEngine(fail=fail), batch_size=2, max_group_retries=1)
    strategy = FullyAsyncRollout(ctx)
    failed = retries = 0
    for step in range(3):
        r = await strategy(RolloutRequest(rollout_id=step))
        failed += r.metrics["rollout/failed_groups"]
        retries += r.metrics["rollout/group_retries"]
        assert all(s.status is not Status.FAILED for g in r.groups for s in g)
    assert failed > 0 and retries >= failed
    await strategy.close()


async def test_checkpoint_round_trip_restores_buffer_and_in_flight_prompts():
    engine = ToyEngine(token_delay_s=lambda r: 0.0 if sum(r.input_ids) % 2 else 0.05)
    ctx = fully_async_context(engine, batch_size=2, async_buffer_groups=6, over_sampling_batch_size=6)
    strategy = FullyAsyncRollout(ctx)
    r0 = await strategy(RolloutRequest(rollout_id=0, weight_version=0))
    await asyncio.sleep(0.02)  # some groups buffered, slow ones still in flight
    state = json.loads(json.dumps({"strategy": strategy.state_dict(), "data": ctx.data_source.state_dict()}))
    buffered = [pid(b.group) for b in strategy.buffer]
    in_flight = sorted(pid(g) for g in strategy._in_flight.values())
    assert buffered and in_flight
    await strategy.close()

    ctx2 = fully_async_context(ToyEngine(), batch_size=2, async_buffer_groups=6, over_sampling_batch_size=6)
    ctx2.data_source.load_state_dict(state["data"])
    restored = FullyAsyncRollout(ctx2)
    restored.load_state_dict(state["strategy"])
    assert [pid(b.group) for b in restored.buffer] == buffered
    assert all(s.status.is_finished for b in restored.buffer for s in b.group)
    trained = [pid(g) for g in r0.groups]
    for step in range(1, 6):
        trained += [pid(g) for g in (await restored(RolloutRequest(rollout_id=step))).groups]
    assert trained[2 : 2 + min(2, len(buffered))] == buffered[:2], "buffered groups are trained first"
    assert set(in_flight) <= set(trained) | {pid(b.group) for b in restored.buffer} | {
        pid(g) for g in restored._in_flight.values()
    }
    await restored.close()
    served = ctx2.data_source.offset
    back = [pid(g) for g in ctx2.data_source.buffer]
    assert sorted(trained + back) == list(range(served)), "every prompt trained or handed back, once"
    with pytest.raises(ValueError, match="version"):
        FullyAsyncRollout(fully_async_context()).load_state_dict({"version": 99})


async def test_resume_from_the_default_strategys_state_keeps_its_counters():
    from verst.rollout.strategies.inference import InferenceRollout

    default = InferenceRollout(make_context())
    await default(RolloutRequest(rollout_id=0))
    strategy = FullyAsyncRollout(fully_async_context())
    strategy.load_state_dict(default.state_dict())
    assert strategy._counters["rollouts"] == 1 and not strategy.buffer
    assert len((await strategy(RolloutRequest(rollout_id=1))).groups) == 2
    await strategy.close()


async def test_close_aborts_in_flight_and_hands_every_prompt_back_with_partial_tokens():
    engine = ToyEngine(length=lambda r: 40, token_delay_s=lambda r: 0.0 if sum(r.input_ids) % 2 else 0.01)
    ctx = fully_async_context(
        engine, batch_size=2, async_buffer_groups=6, over_sampling_batch_size=6, partial_rollout=True
    )
    strategy = FullyAsyncRollout(ctx)
    r0 = await strategy(RolloutRequest(rollout_id=3))
    await asyncio.sleep(0.05)
    assert strategy._in_flight
    await strategy.close()
    assert engine.abort_calls and engine.abort_calls[-1].endswith("-a-")
    assert not strategy._in_flight and not strategy.buffer
    ds: ListDataSource = ctx.data_source
    trained = [pid(g) for g in r0.groups]
    back = [pid(g) for g in ds.buffer]
    assert sorted(trained + back) == list(range(ds.offset))
    partial = [s for g in ds.buffer for s in g if s.status is Status.ABORTED]
    assert partial, "aborted samples keep their partial tokens with partial_rollout"
    for s in partial:
        s.validate()
        assert 0 < s.response_length < 40 and s.metadata["start_rollout_id"] == 3
    assert_attempts_closed(ctx.sink)


async def test_producer_error_surfaces_in_the_next_call():
    def bad_filter(samples):
        raise ValueError("filter bug")

    import sys
    import types

    mod = types.ModuleType("fa_bad_filter_mod")
    mod.bad = bad_filter
    sys.modules["fa_bad_filter_mod"] = mod
    strategy = FullyAsyncRollout(fully_async_context(dynamic_filters=["fa_bad_filter_mod:bad"]))
    with pytest.raises(ProducerError, match="filter bug"):
        await asyncio.wait_for(strategy(RolloutRequest(rollout_id=0)), 5)
    await strategy.close()
    ds = strategy.context.data_source
    assert sorted(pid(g) for g in ds.buffer) == list(range(ds.offset)), "the prompts were handed back"


async def test_data_source_running_out_returns_what_is_left():
    strategy = FullyAsyncRollout(fully_async_context(prompts=["a", "bb", "ccc"], batch_size=2))
    r0 = await strategy(RolloutRequest(rollout_id=0))
    r1 = await strategy(RolloutRequest(rollout_id=1))
    assert len(r0.groups) == 2 and len(r1.groups) == 1
    assert len((await strategy(RolloutRequest(rollout_id=2))).groups) == 0
    await strategy.close()


async def test_eval_runs_beside_the_producer():
    from verst.rollout.sample import Sample

    ctx = fully_async_context(eval={"datasets": {"tiny": {}}})
    ctx.eval_datasets = {"tiny": [Sample(prompt="e1"), Sample(prompt="e2")]}
    strategy = FullyAsyncRollout(ctx)
    await strategy(RolloutRequest(rollout_id=0))
    ev = await strategy(RolloutRequest(rollout_id=0, evaluation=True))
    assert len(ev.eval["tiny"]) == 2 and "eval/tiny/reward_mean" in ev.metrics
    await strategy.close()


# ---------------------------------------------------------------- property: nothing is lost


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    bumps=st.lists(st.integers(0, 3), min_size=1, max_size=5),
    policy=st.sampled_from(["retry", "drop"]),
    staleness=st.integers(1, 2),
    buffer_extra=st.integers(0, 4),
    partial=st.booleans(),
    filtered=st.booleans(),
)
def test_nothing_is_lost(bumps, policy, staleness, buffer_extra, partial, filtered):
    """taken = trained + buffered/in flight (handed back at close) + dropped-and-counted."""

    async def scenario():
        engine = ToyEngine(token_delay_s=lambda r: 0.0 if sum(r.input_ids) % 3 else 0.002)
        ctx = fully_async_context(
            engine,
            prompts=[f"q{i}" for i in range(60)],
            batch_size=2,
            async_buffer_groups=2 + buffer_extra,
            max_weight_staleness=staleness,
            stale_policy=policy,
            partial_rollout=partial,
            dynamic_filters=["nonzero_std"] if filtered else [],
            max_waves_per_rollout=100,  # the data source runs out first (the bound has its own test)
        )
        strategy = FullyAsyncRollout(ctx)
        trained, dropped, filter_dropped = [], [], 0
        version = 0
        for step, bump in enumerate(bumps):
            version += bump
            engine.weight_version = version
            r = await strategy(RolloutRequest(rollout_id=step, weight_version=version))
            trained += [pid(g) for g in r.groups]
            dropped += [pid(g) for g in strategy.last_dropped_groups]
            filter_dropped += int(r.metrics.get("rollout/dropped/zero_std", 0))
            for g in r.groups:
                assert version - min(v for s in g for v in s.weight_versions) <= staleness
            assert r.metrics["rollout/stale_dropped"] + r.metrics["rollout/aborted_dropped"] == len(
                strategy.last_dropped_groups
            )
            assert len(strategy.buffer) + len(strategy._in_flight) <= 2 + buffer_extra
            await asyncio.sleep(0.003 * bump)
        await strategy.close()
        ds = ctx.data_source
        back = [pid(g) for g in ds.buffer]
        accounted = trained + back + dropped
        assert len(accounted) == len(set(accounted)), "no prompt is in two places"
        missing = set(range(ds.offset)) - set(accounted)
        assert len(missing) == filter_dropped, "only filter drops (counted) are not accounted here"

    asyncio.run(scenario())


async def test_a_cancelled_call_loses_no_group():
    # only "prompt 0" is fast: the call takes it and waits for the slow ones
    engine = ToyEngine(token_delay_s=lambda r: 0.0 if r.input_ids[-1] == ord("0") else 0.5)
    ctx = fully_async_context(engine, batch_size=3, async_buffer_groups=4)
    strategy = FullyAsyncRollout(ctx)
    call = asyncio.create_task(strategy(RolloutRequest(rollout_id=0)))
    for _ in range(500):  # until some fast groups were produced and taken, slow ones generating
        await asyncio.sleep(0.01)
        if strategy.produced_groups and not strategy.buffer:
            break
    assert strategy.produced_groups and not call.done()
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    assert strategy.buffer, "the groups the call had taken are buffered again"
    await strategy.close()
    ds = ctx.data_source
    assert sorted(pid(g) for g in ds.buffer) == list(range(ds.offset))
