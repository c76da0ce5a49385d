"""Partial rollout and the off-policy loss mask on the legacy (v1) path.

Rollout 0 keeps two fast groups while a third is stuck mid-generation; it is aborted with its
partial tokens and goes back to the data source with `start_rollout_id`. Rollout 1 (new
weights) resumes it from its tokens with `max_new_tokens` reduced; with
`mask_offpolicy_in_partial_rollout` the part generated under the old weights gets mask 0.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from legacy_testkit import CharTokenizer, HoldingEngine, assert_complete_streams, legacy_context, token_at

from verst.rollout.protocols import RolloutRequest
from verst.rollout.sample import Status
from verst.rollout_legacy import LegacyRolloutStrategy, generate_rollout

pytestmark = pytest.mark.timeout(60)

MAX_NEW = 8
HELD = 3
PROMPTS = ["slow one", "alpha", "bravo", "delta", "echo", "fox", "golf", "hotel"]


def _engine() -> tuple[HoldingEngine, dict[str, bool]]:
    switch = {"hold": True}
    tok = CharTokenizer()
    engine = HoldingEngine(
        hold=lambda r: HELD if switch["hold"] and tok.decode(r.input_ids).startswith("slow") else None
    )
    return engine, switch


@pytest.mark.parametrize("mask_offpolicy", [True, False])
async def test_aborted_group_is_resumed_next_rollout(tmp_path, mask_offpolicy):
    engine, switch = _engine()
    ctx = legacy_context(
        tmp_path,
        engine,
        PROMPTS,
        over_sampling_batch_size=3,
        max_response_len=MAX_NEW,
        partial_rollout=True,
        mask_offpolicy_in_partial_rollout=mask_offpolicy,
    )
    strategy = LegacyRolloutStrategy(ctx)

    first = await strategy(RolloutRequest(rollout_id=0, weight_version=0))
    assert [g[0].prompt for g in first.groups] == ["alpha", "bravo"]
    assert engine.abort_calls and engine.abort_calls[0].startswith("v1r0")
    assert ctx.data_source.num_buffered_groups == 1
    assert first.metrics["rollout/returned_groups"] == 1.0
    assert first.metrics["rollout/aborted"] == 2.0
    [held] = ctx.data_source.get_samples(1)
    for s in held:
        assert s.status is Status.ABORTED
        assert s.response_length == HELD
        assert s.metadata["start_rollout_id"] == 0
        assert s.weight_versions == [0]
        s.validate()
    ctx.data_source.add_samples([held])

    switch["hold"] = False
    engine.weight_version = 1
    n_requests = len(engine.requests)
    second = await strategy(RolloutRequest(rollout_id=1, weight_version=1))
    resumed = [g for g in second.groups if g[0].prompt == "slow one"]
    assert len(resumed) == 1, [g[0].prompt for g in second.groups]
    prompt_len = len("slow one")
    resume_requests = [r for r in engine.requests[n_requests:] if len(r.input_ids) == prompt_len + HELD]
    assert len(resume_requests) == 2
    assert all(r.sampling.max_new_tokens == MAX_NEW - HELD for r in resume_requests)
    for s in resumed[0]:
        assert s.status is Status.TRUNCATED
        assert s.response_length == MAX_NEW
        prompt_ids = s.tokens[:prompt_len]
        assert s.tokens[prompt_len:] == [token_at(prompt_ids, prompt_len + i) for i in range(MAX_NEW)]
        assert len(s.rollout_logprobs) == MAX_NEW
        assert s.weight_versions == [0, 1]
        assert s.metadata["start_rollout_id"] == 0
        if mask_offpolicy:
            assert s.loss_mask == [0] * HELD + [1] * (MAX_NEW - HELD)
        else:
            assert s.effective_loss_mask() == [1] * MAX_NEW
        s.validate()
    # Fresh groups of the same rollout are on-policy: no start_rollout_id, mask all ones.
    for g in second.groups:
        if g[0].prompt != "slow one":
            assert all("start_rollout_id" not in s.metadata and s.loss_mask is None for s in g)
    assert assert_complete_streams(ctx.sink) > 0


async def test_without_partial_rollout_unfinished_groups_return_as_fresh_prompts(tmp_path):
    engine, _ = _engine()
    ctx = legacy_context(tmp_path, engine, PROMPTS, over_sampling_batch_size=3, max_response_len=MAX_NEW)
    result = await LegacyRolloutStrategy(ctx)(RolloutRequest(rollout_id=0))
    assert len(result.groups) == 2
    [returned] = ctx.data_source.get_samples(1)
    for s in returned:
        assert s.status is Status.PENDING
        assert s.response_length == 0 and s.rollout_logprobs is None
        assert "start_rollout_id" not in s.metadata
    assert assert_complete_streams(ctx.sink) == 6


def test_v1_call_with_the_strategy_args_runs_its_own_loop(tmp_path):
    """A v1 caller writes `generate_rollout(args, rollout_id, data_source)`: with the args the
    strategy built (which carry the runtime) it works from plain synchronous code."""
    engine, switch = _engine()
    switch["hold"] = False
    ctx = legacy_context(tmp_path, engine, PROMPTS, max_response_len=4)
    strategy = LegacyRolloutStrategy(ctx)
    out = generate_rollout(strategy.args, 0, ctx.data_source)
    assert len(out.samples) == 2 and all(len(g) == 2 for g in out.samples)
    assert out.metrics["rollout/kept_groups"] == 2.0
    with pytest.raises(AttributeError, match="read-only"):
        strategy.args.rollout_batch_size = 4


async def test_calling_the_sync_function_inside_an_event_loop_is_refused(tmp_path):
    engine, switch = _engine()
    switch["hold"] = False
    ctx = legacy_context(tmp_path, engine, PROMPTS)
    strategy = LegacyRolloutStrategy(ctx)
    with pytest.raises(RuntimeError, match=r"asyncio\.to_thread"):
        generate_rollout(strategy.args, 0, ctx.data_source)
    out = await asyncio.to_thread(generate_rollout, strategy.args, 0, ctx.data_source)
    assert len(out.samples) == 2


def test_args_without_runtime_name_the_fix(tmp_path):
    from verst.rollout.v1_args import build_v1_args

    engine, _ = _engine()
    ctx = legacy_context(tmp_path, engine, PROMPTS)
    with pytest.raises(TypeError, match="LegacyRuntime"):
        generate_rollout(build_v1_args(ctx.config), 0, ctx.data_source)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    max_new=st.integers(min_value=2, max_value=12),
    held_frac=st.floats(min_value=0.0, max_value=1.0),
    mask_offpolicy=st.booleans(),
)
def test_resume_arithmetic_property(tmp_path_factory, max_new, held_frac, mask_offpolicy):
    """For any split of `max_new` tokens into a held (aborted) part and a resumed part, the
    resumed sample is the uninterrupted one: same tokens, `max_new` log-probs, versions
    [0, 1], and the mask is 0 on exactly the held part iff mask_offpolicy."""
    held = max(1, min(max_new - 1, round(held_frac * max_new)))
    tok = CharTokenizer()
    switch = {"hold": True}
    engine = HoldingEngine(
        hold=lambda r: held if switch["hold"] and tok.decode(r.input_ids).startswith("slow") else None
    )
    ctx = legacy_context(
        tmp_path_factory.mktemp("prop"),
        engine,
        PROMPTS,
        over_sampling_batch_size=3,
        max_response_len=max_new,
        partial_rollout=True,
        mask_offpolicy_in_partial_rollout=mask_offpolicy,
    )
    strategy = LegacyRolloutStrategy(ctx)
    generate_rollout(strategy.args, 0, ctx.data_source)
    switch["hold"] = False
    engine.weight_version = 1
    strategy.runtime.weight_version = 1
    out = generate_rollout(strategy.args, 1, ctx.data_source)
    [group] = [g for g in out.samples if g[0].prompt == "slow one"]
    prompt_len = len("slow one")
    for s in group:
        s.validate()
        assert s.tokens[prompt_len:] == [
            token_at(s.tokens[:prompt_len], prompt_len + i) for i in range(max_new)
        ]
        assert s.rollout_logprobs == pytest.approx([-0.01 * (prompt_len + i) for i in range(max_new)])
        assert s.weight_versions == [0, 1]
        expected = [0] * held + [1] * (max_new - held) if mask_offpolicy else [1] * max_new
        assert s.effective_loss_mask() == expected
