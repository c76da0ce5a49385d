"""The judge reward on real parts: the embedded engine with a tiny model as the judge, `verst
serve`'s OpenAI route on 127.0.0.1, and stub servers only to simulate a slow or dying judge."""

from __future__ import annotations

import asyncio

import pytest
import torch
from aiohttp import web
from inference_testkit import make_context
from serve_testlib import serve, serve_app

from verst.rollout.config import JudgeConfig, RolloutConfig
from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.errors import RolloutFailedError
from verst.rollout.protocols import RolloutRequest
from verst.rollout.rewards import build_reward_fns
from verst.rollout.rewards.judge import EngineJudge, JudgeReward, OpenAIJudge
from verst.rollout.rewards.judge_parsers import JudgeError
from verst.rollout.sample import Sample
from verst.rollout.strategies.inference import InferenceRollout
from verst.rollout.toy import make_tiny_checkpoint

TEMPLATE = "{rubric} Q:{prompt} A:{response} ->"
LOGPROB = {"parser": "yes_no_logprob", "yes": "y", "no": "n", "template": TEMPLATE}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("judge") / "m", seed=0))


def samples(n=6):
    return [Sample(prompt=f"{i}+{i}=", response=str(2 * i + (i % 2)), label=str(2 * i)) for i in range(n)]


async def test_embedded_judge_batched_equals_one_by_one_and_caches(tiny):
    engine = EmbeddedEngine.from_pretrained(tiny, max_batch_size=8)
    try:
        batched = JudgeReward(EngineJudge(engine), JudgeConfig(**LOGPROB, cache=False))
        together = await asyncio.gather(*(batched(s) for s in samples()))
        single = JudgeReward(EngineJudge(engine), JudgeConfig(**LOGPROB, max_concurrency=1))
        one_by_one = [await single(s) for s in samples()]
        assert together == pytest.approx(one_by_one, abs=1e-5)
        assert all(0.0 <= x <= 1.0 for x in together) and len(set(together)) > 1
        again = [await single(s) for s in samples()]
        assert again == one_by_one and single.calls == 6 and single.cache_hits == 6
    finally:
        await engine.close()


async def test_policy_checkpoint_as_judge_is_not_refit(tiny):
    """The judge may load the policy's own checkpoint; refitting the policy leaves it alone."""
    cfg = RolloutConfig(
        reward={
            "type": "judge",
            "judge": {
                **LOGPROB,
                "cache": False,
                "engine": {"type": "embedded", "model_path": tiny, "device": "cpu"},
            },
        }
    )
    judge, _ = build_reward_fns(cfg)
    policy = EmbeddedEngine.from_pretrained(tiny)
    try:
        before = await judge(samples(1)[0])
        state = {k: torch.randn_like(v) for k, v in policy.model.state_dict().items()}
        assert await policy.update_weights_from_tensors(state) == 1
        assert await judge(samples(1)[0]) == before
        assert await (await judge.backend.engine()).get_weight_version() == 0
    finally:
        await policy.close()
        await judge.aclose()


async def test_http_judge_through_verst_serve_matches_the_embedded_judge(tiny):
    """The OpenAI-compatible path (`verst serve` on 127.0.0.1) gives the embedded judge's greedy
    verdict and, for the yes/no tokens among its top-20, the same log-probs."""
    prompt = JudgeReward(EngineJudge(None), JudgeConfig(**LOGPROB)).render(samples(1)[0])
    engine = EmbeddedEngine.from_pretrained(tiny)
    try:
        local = EngineJudge(engine)
        text = await local.verdict(prompt, max_new_tokens=6, yes_no=None)
        lps = await local.verdict(prompt, max_new_tokens=1, yes_no=("y", "n"))
    finally:
        await engine.close()
    async with serve(tiny) as url:
        remote = OpenAIJudge(f"{url}/v1", "m")
        try:
            assert (await remote.verdict(prompt, max_new_tokens=6, yes_no=None)).text == text.text
            got = (await remote.verdict(prompt, max_new_tokens=1, yes_no=("y", "n"))).logprobs
        finally:
            await remote.aclose()
    assert got and all(got[k] == pytest.approx(lps.logprobs[k], abs=1e-4) for k in got)


def stub_judge(delay_s: float, answers: list[str | None]):
    """An OpenAI completions stub: sleeps `delay_s`, answers the next of `answers`; a None, or
    running out of answers, drops the connection (a judge dying)."""

    async def completions(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(delay_s)
        answer = answers.pop(0) if answers else None
        if answer is None:
            request.transport.close()
            return web.Response(status=500)
        return web.json_response({"choices": [{"text": answer}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return serve_app(app)


async def test_slow_judge_times_out_as_a_reward_error():
    async with stub_judge(0.8, ["7"]) as url:
        judge = JudgeReward(OpenAIJudge(f"{url}/v1", "m"), JudgeConfig(url=url, timeout_s=0.2))
        try:
            with pytest.raises(JudgeError, match=r"no verdict within 0\.2 s"):
                await judge(samples(1)[0])
        finally:
            await judge.aclose()


async def test_judge_dying_mid_run_counts_reward_errors_and_the_rollout_goes_on():
    """Two calls die mid-rollout: those samples are reward errors (their groups are dropped and
    counted), the other groups keep their judged rewards."""
    answers = ["8", "6", None, None, *(["5"] * 20)]
    async with stub_judge(0.0, answers) as url:
        judge = JudgeReward(OpenAIJudge(f"{url}/v1", "m"), JudgeConfig(url=url, timeout_s=5, cache=False))
        try:
            ctx = make_context(reward_fn=judge, batch_size=2, n_samples_per_prompt=2, max_concurrency=1)
            result = await InferenceRollout(ctx)(RolloutRequest(0))
        finally:
            await judge.aclose()
    assert result.metrics["rollout/reward_errors"] == 2 and len(result.groups) == 2
    assert sorted(s.reward for g in result.groups for s in g) == [0.5, 0.5, 0.6, 0.8]


async def test_dead_judge_stops_the_rollout_with_one_clear_error():
    async with stub_judge(0.0, []) as url:
        judge = JudgeReward(OpenAIJudge(f"{url}/v1", "m"), JudgeConfig(url=url, timeout_s=5))
        try:
            ctx = make_context(reward_fn=judge, batch_size=2, n_samples_per_prompt=2)
            with pytest.raises(RolloutFailedError, match=r"reward: JudgeError: judge http://127\.0\.0\.1"):
                await InferenceRollout(ctx)(RolloutRequest(0))
        finally:
            await judge.aclose()


async def test_rollout_metrics_count_judge_calls_cache_hits_and_errors_per_rollout(tiny):
    """A real embedded judge: each rollout's metrics hold the judge calls, cache hits and errors
    *that rollout* made (not the run's totals). The ToyEngine answers a prompt the same way every
    time, so a group's second sample is a cache hit; the one prompt longer than the judge's
    context makes its judge call fail — a counted error, not a crash."""
    engine = EmbeddedEngine.from_pretrained(tiny, max_batch_size=8)
    limit = engine.model.config.max_position_embeddings
    prompts = ["a", "b", "x" * (limit + 10), *(f"p{i}" for i in range(20))]
    judge = JudgeReward(EngineJudge(engine), JudgeConfig(**LOGPROB))
    try:
        ctx = make_context(reward_fn=judge, prompts=prompts, batch_size=2, n_samples_per_prompt=2)
        strategy = InferenceRollout(ctx)
        first = (await strategy(RolloutRequest(0))).metrics
        second = (await strategy(RolloutRequest(1))).metrics
    finally:
        await engine.close()
    assert first["reward/judge/calls"] == 2 and first["reward/judge/cache_hits"] == 2
    assert first["reward/judge/errors"] == 0 and first["rollout/reward_errors"] == 0
    # the long prompt's group: one failed call (its twin shares it, a cache hit), both samples
    # reward errors; the next wave's two groups are judged (one kept, one handed back)
    assert second["reward/judge/errors"] == 1 and second["rollout/reward_errors"] == 2
    assert second["reward/judge/calls"] == 4 and second["reward/judge/cache_hits"] == 4
    assert judge.counters() == {"calls": 6, "cache_hits": 6, "errors": 1}
