"""`InferenceRollout`: over-sampling to the target, abort + hand-back, retries, filters, eval."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from collections import Counter

import pytest
from inference_testkit import ToyEngine, assert_attempts_closed, make_context

from verst.rollout.lifecycle import EventKind
from verst.rollout.protocols import Capability, RolloutRequest, RolloutStrategy
from verst.rollout.sample import Sample, Status
from verst.rollout.strategies.inference import InferenceRollout


def prompt_id(group):
    return group[0].metadata["prompt_id"]


async def test_basic_rollout_keeps_batch_size_groups_with_indices_and_metrics(caplog):
    ctx = make_context(batch_size=3, n_samples_per_prompt=4)
    strategy = InferenceRollout(ctx)
    assert isinstance(strategy, RolloutStrategy)
    assert strategy.capabilities == frozenset(Capability) - {Capability.FULLY_ASYNC}
    with caplog.at_level(logging.INFO, logger="verst.rollout.strategies.inference"):
        result = await strategy(RolloutRequest(rollout_id=0, weight_version=0))
    assert len(result.groups) == 3 and all(len(g) == 4 for g in result.groups)
    samples = [s for g in result.groups for s in g]
    assert sorted(s.sample_index for s in samples) == list(range(12))
    assert all(len({s.group_index for s in g}) == 1 for g in result.groups)
    assert all(s.status.is_finished and s.reward is not None for s in samples)
    for s in samples:
        s.validate()
    m = result.metrics
    rewards = [s.reward for s in samples]
    assert m["rollout/reward_mean"] == pytest.approx(sum(rewards) / 12)
    assert m["rollout/kept_groups"] == 3 and m["rollout/response_length_max"] == max(
        s.response_length for s in samples
    )
    for key in ("reward_std", "truncated_frac", "time_s", "generated_tokens", "aborted", "dropped_groups"):
        assert f"rollout/{key}" in m
    assert_attempts_closed(ctx.sink)
    assert Counter(e.kind for e in ctx.sink.events)[EventKind.ATTEMPT_END] == 12
    messages = [r.getMessage() for r in caplog.records]
    assert any("first sample" in msg for msg in messages)
    assert any(msg.startswith("rollout 0 finished") for msg in messages)


async def test_target_reached_aborts_and_returns_every_unused_prompt():
    # Even-numbered prompts finish fast, odd ones are slow: the target is met by the fast ones
    # while the slow ones are still generating and must be aborted and handed back.
    def delay(req):
        return 0.0 if sum(req.input_ids) % 2 == 0 else 0.01

    engine = ToyEngine(length=lambda r: 30, token_delay_s=delay)
    prompts = [f"p{i:02d}" for i in range(40)]
    ctx = make_context(
        engine, prompts=prompts, batch_size=3, over_sampling_batch_size=8, n_samples_per_prompt=2
    )
    result = await InferenceRollout(ctx)(RolloutRequest(rollout_id=1))
    ds = ctx.data_source
    kept = [prompt_id(g) for g in result.groups]
    returned = [prompt_id(g) for g in ds.buffer]
    assert len(kept) == 3
    assert engine.abort_calls and engine.abort_calls[0].endswith("-r1-")
    # None lost: every served prompt is either kept or back in the data source.
    assert sorted(kept + returned) == list(range(ds.offset))
    assert len(returned) == result.metrics["rollout/returned_groups"] > 0
    # Without partial rollout the returned samples are fresh prompts (prompt ids cached).
    for g in ds.buffer:
        for s in g:
            assert s.status is Status.PENDING and s.response_length == 0 and s.reward is None
            assert "start_rollout_id" not in s.metadata
    assert_attempts_closed(ctx.sink)
    assert result.metrics["rollout/aborted"] > 0
    end_statuses = Counter(e.detail["status"] for e in ctx.sink.events if e.kind is EventKind.ATTEMPT_END)
    assert end_statuses["aborted"] > 0 and end_statuses["completed"] >= 6


async def test_partial_rollout_keeps_partial_tokens_and_resumes_them_with_offpolicy_mask():
    def delay(req):
        return 0.0005 if sum(req.input_ids[:3]) % 2 == 0 else 0.005

    engine = ToyEngine(length=lambda r: 30, token_delay_s=delay)
    ctx = make_context(
        engine,
        prompts=[f"p{i:02d}" for i in range(40)],
        batch_size=3,
        over_sampling_batch_size=8,
        n_samples_per_prompt=2,
        max_response_len=40,
        partial_rollout=True,
        mask_offpolicy_in_partial_rollout=True,
    )
    strategy = InferenceRollout(ctx)
    await strategy(RolloutRequest(rollout_id=1, weight_version=0))
    ds = ctx.data_source
    partial = [s for g in ds.buffer for s in g if s.status is Status.ABORTED and s.response_length > 0]
    assert partial, "slow groups should have been aborted mid-generation"
    assert all(s.metadata["start_rollout_id"] == 1 for s in partial)
    resumed_ids = {id(s): s.response_length for s in partial}

    engine.token_delay_s = 0.0
    engine.weight_version = 1
    result = await strategy(RolloutRequest(rollout_id=2, weight_version=1))
    resumed = [s for g in result.groups for s in g if id(s) in resumed_ids]
    assert resumed, "handed-back partial groups are served first and resumed"
    for s in resumed:
        old = resumed_ids[id(s)]
        assert s.loss_mask[:old] == [0] * old and s.loss_mask[old:] == [1] * (s.response_length - old)
        assert s.weight_versions == [0, 1] and s.status.is_finished
        s.validate()


async def test_failing_group_is_resubmitted_then_marked_failed():
    calls = Counter()

    def fail(req):
        text = "".join(chr(i) for i in req.input_ids)
        calls[text] += 1
        if text == "bad":
            return RuntimeError("always broken")
        if text == "flaky" and calls[text] == 1:
            return ConnectionError("once")
        return None

    ctx = make_context(
        ToyEngine(fail=fail),
        prompts=["bad", "flaky", "ok1", "ok2", "ok3"],
        batch_size=4,
        n_samples_per_prompt=1,
        max_group_retries=2,
    )
    strategy = InferenceRollout(ctx)
    result = await strategy(RolloutRequest(rollout_id=0))
    kept = sorted(g[0].prompt for g in result.groups)
    assert kept == ["flaky", "ok1", "ok2", "ok3"]
    assert calls["bad"] == 3 and calls["flaky"] == 2
    (failed,) = strategy.last_failed_groups
    assert failed[0].prompt == "bad" and failed[0].status is Status.FAILED
    assert failed[0].metadata["error"] == "generate: RuntimeError: always broken"
    assert result.metrics["rollout/failed_groups"] == 1
    assert result.metrics["rollout/group_retries"] == 3
    assert strategy.state_dict()["counters"]["failed_groups"] == 1
    assert_attempts_closed(ctx.sink)


async def test_sibling_failure_in_a_group_retries_the_whole_group():
    seen = Counter()

    def fail(req):
        seen[req.rid] += 1
        return ValueError("first try of sample 1") if req.rid.endswith("-1-0") else None

    ctx = make_context(ToyEngine(fail=fail, length=lambda r: 3), batch_size=1, n_samples_per_prompt=3)
    result = await InferenceRollout(ctx)(RolloutRequest(rollout_id=0))
    (group,) = result.groups
    assert all(s.status.is_finished for s in group)
    rids = set(seen)
    assert {rid.rsplit("-", 2)[-2:][1] for rid in rids} == {"0", "1"}, "second attempt has a new request id"
    assert result.metrics["rollout/group_retries"] == 1
    assert_attempts_closed(ctx.sink)


async def test_dynamic_filter_drops_are_counted_per_reason():
    async def constant(sample):
        return 1.0 if sample.prompt.endswith(("0", "5")) else float(sample.sample_index % 2)

    ctx = make_context(
        prompts=[f"q{i}" for i in range(12)],
        reward_fn=constant,
        batch_size=4,
        n_samples_per_prompt=2,
        dynamic_filters=["nonzero_std", "no_aborted"],
    )
    result = await InferenceRollout(ctx)(RolloutRequest(rollout_id=0))
    assert len(result.groups) == 4
    assert all(len({s.reward for s in g}) > 1 for g in result.groups)
    assert result.metrics["rollout/dropped/zero_std"] >= 1
    assert result.metrics["rollout/dropped_groups"] == result.metrics["rollout/dropped/zero_std"]


async def test_reward_errors_are_counted_and_never_trained_on():
    async def picky(sample):
        if sample.prompt == "p1":
            raise ValueError("cannot grade")
        return 1.0

    ctx = make_context(prompts=["p0", "p1", "p2"], reward_fn=picky, batch_size=2)
    result = await InferenceRollout(ctx)(RolloutRequest(rollout_id=0))
    assert sorted(g[0].prompt for g in result.groups) == ["p0", "p2"]
    assert result.metrics["rollout/reward_errors"] == 2
    assert result.metrics["rollout/dropped/reward_error"] == 1


async def test_data_source_running_out_returns_what_it_has():
    ctx = make_context(prompts=["a", "b"], batch_size=5)
    result = await InferenceRollout(ctx)(RolloutRequest(rollout_id=0))
    assert len(result.groups) == 2


async def test_eval_runs_every_dataset_without_lifecycle_events():
    ctx = make_context(
        eval={"datasets": {"small": {"n_samples_per_prompt": 3}, "other": {}}, "temperature": 0.0}
    )
    ctx.eval_datasets = {
        "small": [Sample(prompt=f"e{i}", label=i) for i in range(4)],
        "other": [Sample(prompt="z")],
    }
    result = await InferenceRollout(ctx)(RolloutRequest(rollout_id=5, evaluation=True))
    assert result.groups == [] and set(result.eval) == {"small", "other"}
    assert [len(g) for g in result.eval["small"]] == [3, 3, 3, 3]
    assert len(result.eval["other"]) == 1
    samples = [s for g in result.eval["small"] for s in g]
    assert result.metrics["eval/small/reward_mean"] == pytest.approx(sum(s.reward for s in samples) / 12)
    assert "eval/other/reward_mean" in result.metrics
    assert ctx.sink.events == []
    assert all(r.sampling.temperature == 0.0 for r in ctx.engine.requests)
    assert ctx.eval_datasets["small"][0].status is Status.PENDING, "eval prompts are cloned, not consumed"


async def test_state_dict_round_trip_and_version_check():
    ctx = make_context()
    a = InferenceRollout(ctx)
    await a(RolloutRequest(rollout_id=0))
    b = InferenceRollout(make_context())
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict() and a.state_dict()["counters"]["rollouts"] == 1
    with pytest.raises(ValueError, match="version"):
        b.load_state_dict({"version": 99})
    await a.close()


async def test_two_strategies_on_one_engine_abort_only_their_own_requests():
    engine = ToyEngine(length=lambda r: 20, token_delay_s=lambda r: 0.0005 if sum(r.input_ids) % 2 else 0.003)
    ctx_a = make_context(engine, batch_size=1, over_sampling_batch_size=4)
    ctx_b = make_context(engine, batch_size=2, over_sampling_batch_size=4)
    a, b = InferenceRollout(ctx_a), InferenceRollout(ctx_b)
    ra, rb = await asyncio.gather(a(RolloutRequest(rollout_id=0)), b(RolloutRequest(rollout_id=0)))
    assert len(ra.groups) == 1 and len(rb.groups) == 2
    assert all(s.status.is_finished for g in rb.groups for s in g)
    prefixes = set(engine.abort_calls)
    assert len(prefixes) == 2 and all(p and p.endswith("-r0-") for p in prefixes)
    for req in engine.requests:  # each request belongs to exactly one strategy's prefix
        assert sum(req.rid.startswith(p) for p in prefixes) == 1


@pytest.mark.skipif(
    importlib.util.find_spec("verst.rollout.engines.embedded.engine") is None,
    reason="embedded engine not built yet",
)
@pytest.mark.timeout(120)
async def test_inference_rollout_against_the_embedded_engine(tiny_checkpoint):
    import torch

    from verst.rollout.engines.embedded.engine import EmbeddedEngine

    torch.set_num_threads(1)
    engine = EmbeddedEngine.from_pretrained(tiny_checkpoint, device="cpu")
    try:
        ctx = make_context(
            engine,
            prompts=["1+1=", "2+2=", "3+3=", "4+4="],
            batch_size=2,
            n_samples_per_prompt=2,
            max_response_len=6,
            over_sampling_batch_size=3,
            seed=3,
            data={"apply_chat_template": True},
        )
        ctx.tokenizer = engine.tokenizer
        result = await InferenceRollout(ctx)(RolloutRequest(rollout_id=0))
        assert len(result.groups) == 2
        for s in (s for g in result.groups for s in g):
            s.validate()
            assert s.status.is_finished and 0 < s.response_length <= 6
            assert len(s.rollout_logprobs) == s.response_length
            assert all(lp <= 0.0 for lp in s.rollout_logprobs)
            assert s.tokens[: s.prompt_length] == engine.tokenizer.encode(s.prompt, add_special_tokens=False)
            assert s.weight_versions == [0]
        assert_attempts_closed(ctx.sink)
        served = ctx.data_source.offset
        assert len(result.groups) + len(ctx.data_source.buffer) == served
    finally:
        await engine.close()


async def test_failed_engine_abort_surfaces_and_still_loses_no_prompt():
    from verst.rollout.engine import EngineError

    class UnreachableOnAbort(ToyEngine):
        async def abort(self, rid_prefix=None):
            await super().abort(rid_prefix)  # the reachable worker stops...
            raise EngineError("worker http://10.0.0.2:30000 unreachable during abort")

    def delay(req):
        return 0.0 if sum(req.input_ids) % 2 == 0 else 0.005

    engine = UnreachableOnAbort(length=lambda r: 30, token_delay_s=delay)
    ctx = make_context(
        engine, prompts=[f"p{i:02d}" for i in range(40)], batch_size=2, over_sampling_batch_size=8
    )
    with pytest.raises(EngineError, match="unreachable"):
        await InferenceRollout(ctx)(RolloutRequest(rollout_id=0))
    ds = ctx.data_source
    assert sorted(prompt_id(g) for g in ds.buffer) == list(range(ds.offset)), "kept groups go back too"
    assert_attempts_closed(ctx.sink)
