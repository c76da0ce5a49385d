"""The legacy v1 path at the wave bound behaves like the default strategy (issue 25, item 18):
when `max_waves_per_rollout` waves were pulled and every group was dropped, the rollout raises
`RolloutStalledError` naming the drop reasons — it used to return an empty batch, which the
trainer cannot train on. With some groups kept, the short batch is returned and counted
(`rollout/wave_limit_hit = 1`), as documented for the default strategy."""

from __future__ import annotations

import asyncio

import pytest
from legacy_testkit import HoldingEngine, legacy_context

from verst.rollout.protocols import RolloutRequest
from verst.rollout.sample import Sample
from verst.rollout.strategies.inference import RolloutStalledError
from verst.rollout_legacy import LegacyRolloutStrategy

PROMPTS = [f"p{i}" for i in range(6)]  # 3 waves of 2 groups: one pass, no epoch wrap


async def _constant(sample: Sample) -> float:
    return 0.0  # every group has equal rewards: nonzero_std drops them all


async def _only_p0_varies(sample: Sample) -> float:
    return float(sample.prompt == "p0" and sample.sample_index % 2)


async def test_every_group_dropped_at_the_wave_bound_is_a_stall_error(tmp_path):
    ctx = legacy_context(
        tmp_path, HoldingEngine(), PROMPTS, max_response_len=3, dynamic_filters=["nonzero_std"],
        max_waves_per_rollout=3,
    )  # fmt: skip
    ctx.reward_fn = _constant
    with pytest.raises(RolloutStalledError, match=r"zero_std.*max_waves_per_rollout") as info:
        await asyncio.wait_for(LegacyRolloutStrategy(ctx)(RolloutRequest(rollout_id=0)), 30)
    assert "kept 0 of 2" in str(info.value)


async def test_some_groups_kept_at_the_wave_bound_is_a_counted_short_batch(tmp_path):
    ctx = legacy_context(
        tmp_path, HoldingEngine(), PROMPTS, max_response_len=3, dynamic_filters=["nonzero_std"],
        max_waves_per_rollout=3,
    )  # fmt: skip
    ctx.reward_fn = _only_p0_varies
    result = await asyncio.wait_for(LegacyRolloutStrategy(ctx)(RolloutRequest(rollout_id=0)), 30)
    assert [g[0].prompt for g in result.groups] == ["p0"]
    assert result.metrics["rollout/wave_limit_hit"] == 1.0
