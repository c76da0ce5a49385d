"""The legacy v1 strategy: dynamic filters only ever see finished groups; an aborted group is
handed back to the data source, never dropped as `zero_std` (the default strategy's rule)."""

from __future__ import annotations

import pytest
from legacy_testkit import HoldingEngine, legacy_context

from verst.rollout.engine import GenerateOutput, GenerateRequest
from verst.rollout.protocols import RolloutRequest
from verst.rollout_legacy import LegacyRolloutStrategy

pytestmark = pytest.mark.timeout(60)


class AbortsP0Once(HoldingEngine):
    """Simulates an engine that aborts the first requests of prompt 'p0' (one token, `abort`)."""

    def __init__(self) -> None:
        super().__init__()
        self.left = 2

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        if "".join(map(chr, request.input_ids)) == "p0" and self.left:
            self.left -= 1
            self.requests.append(request)
            return GenerateOutput([97], [-0.1], "abort", self.weight_version, len(request.input_ids))
        return await super().generate(request)


async def index_reward(sample):
    return float(sample.sample_index % 2)


async def test_legacy_aborted_group_is_handed_back_not_dropped_by_filters(tmp_path):
    ctx = legacy_context(
        tmp_path, AbortsP0Once(), [f"p{i}" for i in range(6)], dynamic_filters=["nonzero_std"]
    )
    ctx.reward_fn = index_reward
    result = await LegacyRolloutStrategy(ctx)(RolloutRequest(rollout_id=0))
    assert [g[0].prompt for g in result.groups] == ["p1", "p2"]
    assert "rollout/dropped/zero_std" not in result.metrics, result.metrics
    back = ctx.data_source.get_samples(ctx.data_source.num_buffered_groups)
    assert "p0" in [g[0].prompt for g in back], "the aborted prompt went back"
