"""Rollout correctness under aborts, filters and faults (issue #13, rollout side).

Each test is named after the behaviour it pins; the engines are `inference_testkit.ToyEngine`
variants that simulate one fault each (an engine that aborts some requests, one that fails).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from inference_testkit import ToyEngine, make_context

from verst.rollout.config import DataConfig
from verst.rollout.data import PromptDataSource
from verst.rollout.engine import GenerateOutput, GenerateRequest
from verst.rollout.engines.common.errors import InvalidRequest
from verst.rollout.errors import RolloutFailedError
from verst.rollout.protocols import RolloutRequest
from verst.rollout.sample import Sample, Status
from verst.rollout.strategies.fully_async import FullyAsyncRollout
from verst.rollout.strategies.inference import InferenceRollout, RolloutStalledError

pytestmark = pytest.mark.timeout(60)


def prompt_text(request: GenerateRequest) -> str:
    return "".join(chr(i) for i in request.input_ids)


class AbortingEngine(ToyEngine):
    """Simulates an engine that aborts the first `times` requests of some prompts."""

    def __init__(self, abort_prompts: set[str], times: int = 2, **kw) -> None:
        super().__init__(**kw)
        self.left = dict.fromkeys(abort_prompts, times)

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        text = prompt_text(request)
        if self.left.get(text, 0) > 0:
            self.left[text] -= 1
            self.requests.append(request)
            return GenerateOutput(
                output_ids=[70],
                output_logprobs=[-0.1],
                finish_reason="abort",
                weight_version=self.weight_version,
                prompt_tokens=len(request.input_ids),
            )
        return await super().generate(request)


async def index_reward(sample: Sample) -> float:
    """Distinct rewards within every group (so `nonzero_std` keeps every finished group)."""
    return float(sample.sample_index % 2)


@pytest.mark.parametrize("filters", [[], ["nonzero_std"], ["nonzero_std", "no_aborted"]])
async def test_aborted_groups_are_handed_back_never_dropped_by_filters(filters):
    ctx = make_context(
        AbortingEngine({"prompt 0", "prompt 1"}), reward_fn=index_reward, dynamic_filters=filters
    )
    result = await InferenceRollout(ctx)(RolloutRequest(rollout_id=0))
    assert [g[0].metadata["prompt_id"] for g in result.groups] == [2, 3]
    assert result.metrics["rollout/returned_groups"] == 2.0
    assert not any(k.startswith("rollout/dropped/") for k in result.metrics), result.metrics
    assert sorted(g[0].metadata["prompt_id"] for g in ctx.data_source.buffer) == [0, 1]


async def test_fully_async_aborted_groups_are_retried_never_dropped_by_filters():
    ctx = make_context(
        AbortingEngine({"prompt 0", "prompt 1"}),
        reward_fn=index_reward,
        dynamic_filters=["nonzero_std"],
        fully_async=True,
        async_buffer_groups=2,
    )
    strategy = FullyAsyncRollout(ctx)
    seen = []
    for step in range(3):
        result = await strategy(RolloutRequest(rollout_id=step))
        seen += [g[0].metadata["prompt_id"] for g in result.groups]
        assert not any(k.startswith("rollout/dropped/") for k in result.metrics), result.metrics
    await strategy.close()
    assert {0, 1} <= set(seen), "the aborted prompts were regenerated and trained on"


class RefitAbortEngine(ToyEngine):
    """Simulates an engine whose weight update aborts the requests running on it: each
    prompt's first request returns one token and `abort`, and the update lands right after."""

    def __init__(self, only: set[str] | None = None, **kw) -> None:
        super().__init__(**kw)
        self.first: set[str] = set()
        self.only = only

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        text = prompt_text(request).rstrip("F")  # the prompt, without a resumed partial response
        if text not in self.first and (self.only is None or text in self.only):
            self.first.add(text)
            self.requests.append(request)
            out = GenerateOutput(
                output_ids=[70],
                output_logprobs=[-0.1],
                finish_reason="abort",
                weight_version=self.weight_version,
                prompt_tokens=len(request.input_ids),
            )
            self.weight_version += 1  # the refit that aborted it
            return out
        return await super().generate(request)


async def test_offpolicy_mask_follows_token_versions_not_rollout_ids():
    ctx = make_context(
        RefitAbortEngine(length=lambda r: 4),
        fully_async=True,
        async_buffer_groups=2,
        batch_size=1,
        n_samples_per_prompt=1,
        partial_rollout=True,
        mask_offpolicy_in_partial_rollout=True,
        max_weight_staleness=10,
    )
    strategy = FullyAsyncRollout(ctx)
    result = await strategy(RolloutRequest(rollout_id=0, weight_version=0))
    await strategy.close()
    (sample,) = result.groups[0]
    assert len(sample.weight_versions) == 2 and sample.weight_versions[0] < sample.weight_versions[1]
    assert sample.loss_mask == [0] + [1] * (sample.response_length - 1), "the old-weights prefix is masked"
    old, new = sample.weight_versions
    assert sample.token_versions == [old] + [new] * (sample.response_length - 1)
    sample.validate()


async def test_partial_resume_under_unchanged_weights_is_not_masked():
    ctx = make_context(
        RefitAbortEngine({"prompt 0"}, length=lambda r: 4),
        batch_size=1,
        n_samples_per_prompt=1,
        partial_rollout=True,
        mask_offpolicy_in_partial_rollout=True,
    )
    engine = ctx.engine
    strategy = InferenceRollout(ctx)
    await strategy(RolloutRequest(rollout_id=0))  # prompt 0 aborted (handed back), prompt 1 kept
    engine.weight_version = 0  # the "refit" never happened: same weights next rollout
    result = await strategy(RolloutRequest(rollout_id=1))
    resumed = [s for g in result.groups for s in g if s.metadata["prompt_id"] == 0]
    assert resumed and resumed[0].weight_versions == [0, 0]
    assert resumed[0].loss_mask is None, "tokens of the same weights stay trained on"


# ----------------------------------------------------------------------------- bounded rollouts


def cycling_context(tmp_path, engine=None, n_prompts: int = 4, **config):
    """`make_context`, over a real `PromptDataSource` (it cycles epochs forever)."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(n_prompts)))
    ctx = make_context(engine, **config)
    ctx.data_source = PromptDataSource(
        DataConfig(path=str(path), shuffle=False), ctx.config.n_samples_per_prompt
    )
    return ctx


async def test_all_groups_filtered_ends_with_a_clear_error_not_an_endless_loop(tmp_path):
    ctx = cycling_context(tmp_path, dynamic_filters=["nonzero_std"])  # equal rewards in every group
    with pytest.raises(RolloutStalledError, match=r"zero_std=20.*max_waves_per_rollout") as info:
        await asyncio.wait_for(InferenceRollout(ctx)(RolloutRequest(rollout_id=0)), 20)
    assert "kept 0 of 2" in str(info.value)


async def test_wave_limit_returns_the_groups_kept_and_counts_it(tmp_path):
    async def only_prompt_0_varies(sample: Sample) -> float:
        return float(sample.prompt == "prompt 0" and sample.sample_index % 2)

    ctx = cycling_context(
        tmp_path,
        n_prompts=6,
        reward_fn=only_prompt_0_varies,
        dynamic_filters=["nonzero_std"],
        batch_size=2,
        max_waves_per_rollout=3,
    )
    result = await asyncio.wait_for(InferenceRollout(ctx)(RolloutRequest(rollout_id=0)), 20)
    assert [g[0].prompt for g in result.groups] == ["prompt 0"]
    assert result.metrics["rollout/wave_limit_hit"] == 1.0 and result.metrics["rollout/waves"] == 3.0


async def test_fully_async_all_groups_filtered_ends_with_a_clear_error(tmp_path):
    ctx = cycling_context(tmp_path, dynamic_filters=["nonzero_std"], fully_async=True, async_buffer_groups=2)
    strategy = FullyAsyncRollout(ctx)
    with pytest.raises(RolloutStalledError, match="zero_std"):
        await asyncio.wait_for(strategy(RolloutRequest(rollout_id=0)), 20)
    await strategy.close()


async def test_an_engine_that_always_fails_stops_the_rollout_naming_it_and_loses_no_prompt(tmp_path):
    engine = ToyEngine(fail=lambda r: ConnectionError("connection refused by 127.0.0.1:9"))
    ctx = cycling_context(tmp_path, engine, n_prompts=40, max_group_retries=1)
    with pytest.raises(RolloutFailedError, match=r"3 groups in a row.*connection refused.*ToyEngine") as info:
        await asyncio.wait_for(InferenceRollout(ctx)(RolloutRequest(rollout_id=0)), 20)
    assert "generate function: SingleTurnGenerate" in str(info.value)
    submitted = {prompt_text(r) for r in engine.requests}
    back = ctx.data_source.get_samples(ctx.data_source.num_buffered_groups)
    assert {g[0].prompt for g in back} == submitted, "every prompt in play went back"
    assert all(s.status is Status.PENDING for g in back for s in g)


async def test_a_reward_function_that_always_raises_stops_the_rollout_naming_it(tmp_path):
    async def broken_reward(sample: Sample) -> float:
        raise KeyError("answer")

    ctx = cycling_context(tmp_path, reward_fn=broken_reward)
    with pytest.raises(RolloutFailedError, match=r"reward: KeyError: 'answer'"):
        await asyncio.wait_for(InferenceRollout(ctx)(RolloutRequest(rollout_id=0)), 20)
    back = ctx.data_source.get_samples(ctx.data_source.num_buffered_groups)
    assert len(back) >= 3 and all(s.status is Status.PENDING and s.reward is None for g in back for s in g)


async def test_fully_async_engine_that_always_fails_stops_with_the_error(tmp_path):
    engine = ToyEngine(fail=lambda r: ConnectionError("engine down"))
    ctx = cycling_context(tmp_path, engine, max_group_retries=0, fully_async=True, async_buffer_groups=2)
    strategy = FullyAsyncRollout(ctx)
    with pytest.raises(RolloutFailedError, match="engine down"):
        await asyncio.wait_for(strategy(RolloutRequest(rollout_id=0)), 20)
    await strategy.close()
    assert ctx.data_source.num_buffered_groups >= 3, "the failed prompts went back"


async def test_a_request_the_engine_refuses_is_failed_at_once_not_resubmitted():
    engine = ToyEngine(fail=lambda r: InvalidRequest("prompt of 9000 tokens exceeds the context of 4096"))
    ctx = make_context(engine, batch_size=1, max_group_retries=2, n_samples_per_prompt=1)
    strategy = InferenceRollout(ctx)
    with pytest.raises(RolloutFailedError):
        await strategy(RolloutRequest(rollout_id=0))
    assert len(engine.requests) == 2, "one request per group: a 4xx is not retried"
