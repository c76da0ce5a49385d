"""Rollout correctness under aborts, filters and faults (issue #13, rollout side).

Each test is named after the behaviour it pins; the engines are `inference_testkit.ToyEngine`
variants that simulate one fault each (an engine that aborts some requests, one that fails).
"""

from __future__ import annotations

import pytest
from inference_testkit import ToyEngine, make_context

from verst.rollout.engine import GenerateOutput, GenerateRequest
from verst.rollout.protocols import RolloutRequest
from verst.rollout.sample import Sample
from verst.rollout.strategies.fully_async import FullyAsyncRollout
from verst.rollout.strategies.inference import InferenceRollout

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

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.first: set[str] = set()

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        text = prompt_text(request).rstrip("F")  # the prompt, without a resumed partial response
        if text not in self.first:
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
    assert sample.token_versions == [sample.weight_versions[0]] + [sample.weight_versions[1]] * 3
    sample.validate()


async def test_partial_resume_under_unchanged_weights_is_not_masked():
    ctx = make_context(
        RefitAbortEngine(length=lambda r: 4),
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
