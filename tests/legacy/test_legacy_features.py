"""Features the legacy strategy declares, exercised on the legacy path itself.

v1 custom generate and group reward functions (in `legacy_v1_functions`, written for the v1
ABI), per-sample generate overrides, dynamic filters with over-sampling, eval, close during a
rollout, and the strategy's resumable state.
"""

from __future__ import annotations

import asyncio

import legacy_v1_functions
import pytest
from legacy_testkit import (
    CharTokenizer,
    HoldingEngine,
    assert_complete_streams,
    legacy_context,
    write_prompts,
)

from verst.rollout.config import EvalConfig, EvalDatasetConfig, RewardConfig
from verst.rollout.data_sources import build_eval_sets
from verst.rollout.protocols import RolloutRequest
from verst.rollout.rewards.registry import build_reward_fns
from verst.rollout.sample import Status
from verst.rollout_legacy import LegacyRolloutStrategy
from verst.rollout_legacy.rollout import RolloutFailedError

pytestmark = pytest.mark.timeout(60)

PROMPTS = [f"p{i}" for i in range(12)]


async def test_v1_generate_function_runs_on_the_legacy_path_train_and_eval(tmp_path):
    legacy_v1_functions.CALLS.clear()
    eval_file = write_prompts(tmp_path / "eval.jsonl", ["e1", "e2"])
    ctx = legacy_context(
        tmp_path,
        HoldingEngine(),
        PROMPTS,
        max_response_len=5,
        generate_function_path="legacy_v1_functions:v1_generate",
        eval=EvalConfig(datasets={"small": EvalDatasetConfig(path=str(eval_file))}, max_response_len=3),
    )
    ctx.eval_datasets = build_eval_sets(ctx.config.eval)
    strategy = LegacyRolloutStrategy(ctx)
    result = await strategy(RolloutRequest(rollout_id=3, weight_version=2))
    samples = [s for g in result.groups for s in g]
    assert len(samples) == 4
    for s in samples:
        assert s.metadata["generated_by"] == "v1_generate" and s.response.endswith("!")
        assert s.response_length == 5 and s.reward is not None
        s.validate()
    train_calls = [c for c in legacy_v1_functions.CALLS if not c["evaluation"]]
    assert {c["max_new_tokens"] for c in train_calls} == {5}
    assert {c["rollout_max_response_len"] for c in train_calls} == {5}
    assert {e.weight_version for e in ctx.sink.events} == {2}
    assert assert_complete_streams(ctx.sink) == 4

    n_events = len(ctx.sink.events)
    evaluation = await strategy(RolloutRequest(rollout_id=3, evaluation=True))
    assert [len(g) for g in evaluation.eval["small"]] == [1, 1]
    assert all(g[0].response_length == 3 for g in evaluation.eval["small"])
    assert "eval/small/reward_mean" in evaluation.metrics
    assert [c["evaluation"] for c in legacy_v1_functions.CALLS[-2:]] == [True, True]
    assert len(ctx.sink.events) == n_events, "eval emits no lifecycle events"


async def test_per_sample_generate_override(tmp_path):
    ctx = legacy_context(tmp_path, HoldingEngine(), PROMPTS, max_response_len=4)
    original = ctx.data_source.get_samples

    def get_samples(num_groups):
        groups = original(num_groups)
        for g in groups:
            if g[0].prompt == "p1":
                for s in g:
                    s.generate_function_path = "legacy_v1_functions:v1_generate"
        return groups

    ctx.data_source.get_samples = get_samples
    result = await LegacyRolloutStrategy(ctx)(RolloutRequest(rollout_id=0))
    by_prompt = {g[0].prompt: g for g in result.groups}
    assert all(s.metadata.get("generated_by") == "v1_generate" for s in by_prompt["p1"])
    assert all("generated_by" not in s.metadata for s in by_prompt["p0"])


async def test_group_reward_dynamic_filter_and_over_sampling(tmp_path):
    ctx = legacy_context(
        tmp_path,
        HoldingEngine(),
        PROMPTS,
        batch_size=2,
        over_sampling_batch_size=4,
        max_response_len=3,
        reward=RewardConfig(type="legacy_v1_functions:group_reward", group=True),
        dynamic_filters=["legacy_v1_functions:keep_even_groups"],
    )
    ctx.reward_fn, ctx.group_reward_fn = build_reward_fns(ctx.config)
    strategy = LegacyRolloutStrategy(ctx)
    assert strategy.args.group_rm is True and strategy.args.over_sampling_batch_size == 4
    result = await strategy(RolloutRequest(rollout_id=0))
    assert [g[0].group_index for g in result.groups] == [0, 2]
    assert all(sorted(s.reward for s in g) == [0.0, 1.0] for g in result.groups)
    assert result.metrics["rollout/dropped/keep_even_groups"] >= 1.0
    assert result.metrics["rollout/kept_groups"] == 2.0
    assert assert_complete_streams(ctx.sink) == 8


async def test_close_during_a_rollout_hands_everything_back(tmp_path):
    engine = HoldingEngine(hold=lambda r: 1)  # every request emits one token, then waits
    ctx = legacy_context(tmp_path, engine, PROMPTS, max_response_len=4, partial_rollout=True)
    strategy = LegacyRolloutStrategy(ctx)
    call = asyncio.create_task(strategy(RolloutRequest(rollout_id=0)))
    while len(engine.requests) < 4:
        await asyncio.sleep(0.01)
    await strategy.close()
    result = await call
    assert result.groups == []
    assert ctx.data_source.num_buffered_groups == 2
    returned = ctx.data_source.get_samples(2)
    assert all(s.status is Status.ABORTED and s.response_length == 1 for g in returned for s in g)
    assert assert_complete_streams(ctx.sink) == 4
    with pytest.raises(RuntimeError, match="closed"):
        await strategy(RolloutRequest(rollout_id=1))


async def test_state_dict_round_trip(tmp_path):
    ctx = legacy_context(tmp_path, HoldingEngine(), PROMPTS, max_response_len=2)
    strategy = LegacyRolloutStrategy(ctx)
    await strategy(RolloutRequest(rollout_id=0))
    await strategy(RolloutRequest(rollout_id=1))
    state = strategy.state_dict()
    assert state["num_rollouts"] == 2 and state["last_rollout_id"] == 1
    fresh = LegacyRolloutStrategy(
        legacy_context(tmp_path, HoldingEngine(), PROMPTS, tokenizer=CharTokenizer())
    )
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    with pytest.raises(ValueError, match="version"):
        fresh.load_state_dict({**state, "version": 99})


class _BrokenEngine(HoldingEngine):
    """Simulates an engine that fails every request."""

    async def generate(self, request):
        self.requests.append(request)
        raise ConnectionError("engine down")


async def test_consistent_generation_failure_stops_with_a_clear_error(tmp_path):
    ctx = legacy_context(tmp_path, _BrokenEngine(), PROMPTS, max_group_retries=1)
    with pytest.raises(RolloutFailedError, match="engine down") as info:
        await LegacyRolloutStrategy(ctx)(RolloutRequest(rollout_id=0))
    assert info.value.num_failed == 3
    assert all("ConnectionError: engine down" in e for e in info.value.errors)
    # Every submitted group went back to the data source as a fresh prompt: none is lost.
    submitted = {r.rid.split("-")[1] for r in ctx.engine.requests}  # sample indices
    returned = ctx.data_source.get_samples(ctx.data_source.num_buffered_groups)
    assert len(returned) * 2 == len(submitted)
    assert all(s.status is Status.PENDING and "error" not in s.metadata for g in returned for s in g)
    assert assert_complete_streams(ctx.sink) == 2 * len(submitted)  # two tries per sample


async def test_cancelling_the_call_stops_the_rollout_and_hands_groups_back(tmp_path):
    engine = HoldingEngine(hold=lambda r: 2)
    ctx = legacy_context(tmp_path, engine, PROMPTS, max_response_len=4, partial_rollout=True)
    strategy = LegacyRolloutStrategy(ctx)
    call = asyncio.create_task(strategy(RolloutRequest(rollout_id=0)))
    while len(engine.requests) < 4:
        await asyncio.sleep(0.01)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert ctx.data_source.num_buffered_groups == 2
    assert all(s.response_length == 2 for g in ctx.data_source.get_samples(2) for s in g)
    assert assert_complete_streams(ctx.sink) == 4
    # Not closed: the next rollout runs normally.
    engine.hold = lambda r: None
    result = await strategy(RolloutRequest(rollout_id=1))
    assert len(result.groups) == 2


async def test_v1_multi_turn_generate_with_its_own_loss_mask_runs_unchanged(tmp_path):
    """A v1 function that builds one multi-turn sample with its own loss mask (slime's way) runs
    unchanged on the legacy path, and is trained exactly as it built it."""
    ctx = legacy_context(
        tmp_path, HoldingEngine(), PROMPTS, max_response_len=3,
        generate_function_path="legacy_v1_functions:v1_multi_turn_generate",
    )  # fmt: skip
    result = await LegacyRolloutStrategy(ctx)(RolloutRequest(rollout_id=0))
    samples = [s for g in result.groups for s in g]
    assert len(samples) == 4
    for s in samples:
        s.validate()
        assert s.response_length == 3 + 5 + 3 and "|obs|" in s.response
        assert s.loss_mask == [1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1]
    assert assert_complete_streams(ctx.sink) == 4
