"""Rollout correctness under aborts, filters and faults (issue #13, rollout side).

Each test is named after the behaviour it pins; the engines are `inference_testkit.ToyEngine`
variants that simulate one fault each (an engine that aborts some requests, one that fails).
"""

from __future__ import annotations

import asyncio

import pytest
from inference_testkit import ToyEngine, make_context

from verst.rollout.engine import GenerateOutput, GenerateRequest
from verst.rollout.protocols import RolloutRequest
from verst.rollout.sample import Sample, Status
from verst.rollout.strategies.fully_async import FullyAsyncRollout
from verst.rollout.strategies.inference import InferenceRollout

pytestmark = pytest.mark.timeout(60)


def prompt_text(request: GenerateRequest) -> str:
    return "".join(chr(i) for i in request.input_ids)


class AbortingEngine(ToyEngine):
    """Simulates an engine that aborts the first request of each sample of some prompts."""

    def __init__(self, abort_prompts: set[str], **kw) -> None:
        super().__init__(**kw)
        self.abort_prompts = abort_prompts
        self.seen: set[str] = set()

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        text = prompt_text(request)
        sample = request.rid.rsplit("-", 2)[-2]
        if text in self.abort_prompts and (text, sample) not in self.seen:
            self.seen.add((text, sample))
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
