"""MoE routing recorded at rollout: the embedded engine (continuous batching, grouped attention,
prefix sharing) returns each position's experts, `verst serve` sends them in SGLang's wire form
and the SGLang client reads them back; single-turn samples and agentic trajectories carry them."""

from __future__ import annotations

import asyncio

import pytest
import torch

from verst.rollout.agentic.trajectory import append_turn
from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.moe import RoutedExperts, RouterHooks
from verst.rollout.sample import Sample
from verst.rollout.toy_moe import make_tiny_moe_checkpoint


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_moe_checkpoint(tmp_path_factory.mktemp("moe") / "m", family="qwen3_moe", num_layers=2)


def _free_routing(model, ids: list[int]) -> torch.Tensor:
    """The routers' own choices over a teacher-forced forward of `ids`: `[len - 1, layers × k]`."""
    hooks = RouterHooks(model)
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
        return hooks.chosen().reshape(len(ids), -1)[:-1]
    finally:
        hooks.close()


PROMPTS = [[5, 9, 14, 7, 11], [5, 9, 14, 7, 11], [20, 21, 8], [30, 6, 6, 6, 12, 13, 40]]


async def _generate(engine, start: int = 0) -> list:
    reqs = [
        GenerateRequest(
            p,
            SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=i, ignore_eos=True),
            return_routed_experts=True,
            routed_experts_start_len=start,
        )
        for i, p in enumerate(PROMPTS)
    ]
    return await asyncio.gather(*(engine.generate(r) for r in reqs))


async def test_embedded_engine_records_every_fed_position(moe_dir) -> None:
    from verst.rollout.engines.embedded import EmbeddedEngine

    engine = EmbeddedEngine.from_pretrained(moe_dir, batch_wait_s=0.05)  # grouped attention, prefix sharing
    try:
        assert engine.capabilities.routing_replay
        outs = await _generate(engine)
        assert engine.prefill_tokens_saved == len(PROMPTS[0])  # the shared prompt ran once
        tail = await _generate(engine, start=3)
    finally:
        await engine.close()
    agree = total = 0
    for prompt, out, cut in zip(PROMPTS, outs, tail, strict=True):
        rec = out.routed_experts
        seq = prompt + out.output_ids
        assert rec is not None and rec.tokens == len(seq) - 1 and rec.width == 2 * 2
        ids = rec.to_tensor()
        assert ((ids >= 0) & (ids < 8)).all()
        free = _free_routing(engine.model, seq)
        agree += int(
            (free.reshape(-1, 2).sort(-1).values == ids.reshape(-1, 2).sort(-1).values).all(-1).sum()
        )
        total += free.numel() // 2
        assert cut.routed_experts is not None and cut.routed_experts.tokens == len(prompt) + 6 - 1 - 3
    assert agree / total > 0.97  # same fp32 weights; only rounding of the batched path differs


async def test_dense_model_returns_no_routing(tiny_checkpoint) -> None:
    from verst.rollout.engines.embedded import EmbeddedEngine

    engine = EmbeddedEngine.from_pretrained(tiny_checkpoint)
    try:
        out = await engine.generate(
            GenerateRequest([5, 6, 7], SamplingParams(max_new_tokens=2), return_routed_experts=True)
        )
    finally:
        await engine.close()
    assert out.routed_experts is None


async def test_serve_returns_routing_in_sglang_form_and_the_client_reads_it(moe_dir) -> None:
    from serve_testlib import serve

    from verst.rollout.engines.sglang.client import SGLangClient

    req = GenerateRequest(
        PROMPTS[3], SamplingParams(max_new_tokens=5, temperature=0.0), return_routed_experts=True
    )
    async with serve(moe_dir) as url:
        client = SGLangClient(url)
        try:
            out = await client.generate(req)
            import aiohttp

            from verst.rollout.engines.common.wire import request_json

            async with aiohttp.ClientSession() as s, s.post(f"{url}/generate", json=request_json(req)) as r:
                raw = await r.json()
        finally:
            await client.close()
    meta = raw["meta_info"]
    assert isinstance(meta["routed_experts"], str)  # SGLang 0.5.23: base64 of int32 [seqlen - 1, layers, k]
    rows = meta["prompt_tokens"] + meta["completion_tokens"] - 1
    assert RoutedExperts.from_sglang(meta["routed_experts"], rows) == out.routed_experts
    assert out.routed_experts is not None and out.routed_experts.tokens == len(PROMPTS[3]) + 5 - 1


def test_trajectory_routing_leaves_observations_unrecorded() -> None:
    sample = Sample(tokens=[4, 5, 6])
    turn1 = RoutedExperts.from_ints(list(range(4 * 4)), 4)  # positions 0..3: prompt + 2 generated - 1
    append_turn(sample, [7, 8], [-0.1, -0.2], True, 0, routed_experts=turn1, routed_start=0)
    append_turn(sample, [9, 10, 11], None, False)  # observation
    turn2 = RoutedExperts.from_ints([1, 2, 3, 4] * 2, 4)  # from position 7: the last observation token
    append_turn(sample, [12, 13], [-0.3, -0.4], True, 1, routed_experts=turn2, routed_start=7)
    sample.validate()
    rows = sample.routed_experts.to_tensor()
    assert rows.shape == (len(sample.tokens) - 1, 4)
    assert rows[:4].reshape(-1).tolist() == list(range(16))
    assert (rows[4:7] == -1).all()  # the last model token and the observation: no routing
    assert rows[7:].reshape(-1).tolist() == [1, 2, 3, 4] * 2
    again = Sample.from_dict(sample.to_dict())
    assert again == sample and again.routed_experts == sample.routed_experts
    append_turn(sample, [14], [-0.5], True, 2)  # a turn without routing: the sample drops it
    assert sample.routed_experts is None
