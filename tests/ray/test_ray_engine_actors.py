"""Embedded engines as their own Ray actors (`run.ray.engine_actors`), and memory release/resume.

1. release/resume on the embedded engine itself: generation works after resume (and a request
   arriving while released takes the memory back itself), the weight version is unchanged, and
   weight updates still apply while released.
2. A colocated placement with two engine actors: one rollout is served by both actors (the
   rollout manager load-balances its `ActorEngine` clients), the colocated rollout manager
   releases their memory after the rollout, and a weight push reaches both (same version).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from ray_testlib import install_reward_module, ray_run, run_actors_left, run_dict, write_prompts

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.trainer.config import run_config_from_dict
from verst.trainer.placement import build_ray_placement, placement_problems


def _request(seed: int) -> GenerateRequest:
    return GenerateRequest(
        input_ids=[5, 6, 7],
        sampling=SamplingParams(max_new_tokens=4, temperature=1.0, sampling_seed=seed, ignore_eos=True),
    )


async def _over_http(engine: EmbeddedEngine) -> None:
    """`verst serve`'s /release_memory_occupation and /resume_memory_occupation, via the client."""
    from aiohttp import web

    from verst.rollout.engines.serve.server import build_app
    from verst.rollout.engines.sglang.client import SGLangClient

    runner = web.AppRunner(build_app(engine))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = SGLangClient(f"http://127.0.0.1:{port}")
    try:
        await client.release_memory_occupation(["kv_cache", "cuda_graph"])  # weights stay valid
        assert engine.released
        await client.resume_memory_occupation(["kv_cache", "cuda_graph"])
        assert not engine.released
        assert (await client.generate(_request(3))).weight_version == 3
    finally:
        await client.close()
        await runner.cleanup()  # closes the engine too


def test_embedded_release_resume_keeps_serving(tiny_checkpoint):
    torch.set_num_threads(1)

    async def go() -> None:
        engine = EmbeddedEngine.from_pretrained(tiny_checkpoint, device="cpu", batch_wait_s=0)
        try:
            before = await engine.generate(_request(1))
            await engine.release_memory()
            assert engine.released and engine._batch.cache is None
            await engine.resume_memory()
            assert not engine.released
            after = await engine.generate(_request(1))
            assert after.output_ids == before.output_ids and after.weight_version == 0
            # a request while released takes the memory back; updates apply while released
            await engine.release_memory_occupation()
            assert (await engine.generate(_request(2))).finish_reason == "length"
            assert not engine.released
            await engine.release_memory()
            state = {k: v.clone() for k, v in engine.model.state_dict().items()}
            assert await engine.update_weights_from_tensors(state, 3) == 3
            await engine.resume_memory_occupation()
            assert await engine.get_weight_version() == 3
            await _over_http(engine)
        finally:
            await engine.close()

    asyncio.run(go())


@pytest.mark.slow  # ~70 s on 2 cores (4 actor processes): .ci/run runs tests/ray's slow tests
def test_engine_actors_serve_and_sync(ray_cluster, tmp_path, tiny_checkpoint, monkeypatch):
    torch.set_num_threads(1)
    reward = install_reward_module(tmp_path, monkeypatch)
    data = write_prompts(tmp_path / "prompts.jsonl")
    run = ray_run(num_train_actors=1, layout="colocated", engine_actors=2, cpus_per_engine_actor=0.5)
    cfg = run_config_from_dict(run_dict(tiny_checkpoint, data, reward, run=run))
    assert placement_problems(cfg, {}) == []
    bad = run_config_from_dict(run_dict(tiny_checkpoint, data, reward, run=run, engine={"num_engines": 2}))
    assert [p.key for p in placement_problems(bad, {})] == ["run.ray.engine_actors"]

    placement = build_ray_placement(cfg, tmp_path / "run", model_path=str(tiny_checkpoint), env={})
    try:
        engines = placement.engine_actors
        assert [a.name for a in engines] == ["engine-0", "engine-1"]
        assert placement.rollout.engine_capabilities.weight_sync[0] == "tensors"  # tensors go to the actors
        assert placement.rollout.info["engine_can_release"]
        result = placement.rollout.rollout(0, 0)
        assert len(result.groups) == cfg.rollout.batch_size
        stats = ray_cluster.get([a.handle.stats.remote() for a in engines])
        n = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
        assert sum(s["requests"] for s in stats) == n
        assert all(s["requests"] > 0 for s in stats), stats  # both actors served
        assert all(s["released"] for s in stats)  # colocated: released after the rollout
        assert len({s["pid"] for s in stats}) == 2
        weights = placement.train.state_dict_for_sync()
        assert placement.rollout.update_weights_from_tensors(weights, 1) == 1
        stats = ray_cluster.get([a.handle.stats.remote() for a in engines])
        assert [s["weight_version"] for s in stats] == [1, 1]
        assert not any(s["released"] for s in stats)
        assert placement.rollout.weight_version() == 1
    finally:
        placement.close()
    assert run_actors_left(ray_cluster) == []
