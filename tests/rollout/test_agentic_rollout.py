"""Agentic episodes in the default and fully-async strategies: concurrency, abort, limits,
timeouts, the one-sample-per-input contract, and `[rollout.env]` validation."""

from __future__ import annotations

import asyncio
import time

import pytest
from agentic_testkit import ScriptEngine, assert_episode_streams, context

from verst.rollout.agentic import ModelTurn, StepResult
from verst.rollout.agentic.episode import AgenticGenerate
from verst.rollout.config import RolloutConfig
from verst.rollout.errors import ConfigError
from verst.rollout.generate import GenerateContractError
from verst.rollout.lifecycle import EventKind
from verst.rollout.protocols import Capability, RolloutRequest
from verst.rollout.sample import Sample, Status
from verst.rollout.strategies.inference import InferenceRollout
from verst.rollout.validation import validate_rollout_config


class SleepyEnv:
    """Every step sleeps `sleep_s` (a slow tool), then asks for another turn until `turns`."""

    closed = 0

    def __init__(self, sleep_s: float = 0.0, turns: int = 2, reward: float = 1.0) -> None:
        self.sleep_s, self.turns, self.reward, self.n = sleep_s, turns, reward, 0

    async def reset(self, sample):
        return None

    async def step(self, turn: ModelTurn) -> StepResult:
        await asyncio.sleep(self.sleep_s)
        self.n += 1
        if self.n >= self.turns:
            return StepResult(done=True, reward=self.reward)
        return StepResult(observation=f"[obs {self.n}]", reward=0.5)

    async def close(self):
        type(self).closed += 1


def _strategy(engine, env_factory, *, prompts=None, **config):
    env = {"type": "tools", **config.pop("env", {})}
    ctx = context(engine, prompts=prompts or [f"p{i}:" for i in range(16)], env=env, **config)
    strategy = InferenceRollout(ctx)
    strategy.generate_fn.factory = env_factory
    return strategy, ctx


def test_tool_waits_do_not_hold_the_semaphore():
    """8 episodes, max_concurrency 1, each env step sleeps 0.2 s: with the semaphore per request
    the sleeps overlap (~0.2 s per turn in all), held per episode they would add up (1.6 s+)."""
    engine = ScriptEngine(lambda conv, req: "go")
    strategy, _ = _strategy(
        engine, lambda: SleepyEnv(0.2, turns=1), batch_size=8, n_samples_per_prompt=1, max_concurrency=1
    )
    started = time.perf_counter()
    result = asyncio.run(strategy(RolloutRequest(0)))
    elapsed = time.perf_counter() - started
    assert len(result.groups) == 8 and engine.max_active == 1
    assert elapsed < 1.2, f"tool waits were serialised ({elapsed:.2f}s)"


def test_max_episodes_in_flight_bounds_episodes():
    live = peak = 0

    class Counting(SleepyEnv):
        async def reset(self, sample):
            nonlocal live, peak
            live += 1
            peak = max(peak, live)
            return None

        async def close(self):
            nonlocal live
            live -= 1

    strategy, _ = _strategy(
        ScriptEngine(lambda c, r: "go"),
        lambda: Counting(0.02, turns=2),
        batch_size=6,
        n_samples_per_prompt=1,
        env={"max_episodes_in_flight": 2},
    )
    asyncio.run(strategy(RolloutRequest(0)))
    assert peak == 2


def test_env_reward_final_and_sum_and_turn_rewards_kept():
    for mode, want in (("final", 1.0), ("sum", 1.5)):
        strategy, _ = _strategy(
            ScriptEngine(lambda c, r: "go"), lambda: SleepyEnv(turns=2), env={"reward": mode}
        )
        s = asyncio.run(strategy(RolloutRequest(0))).groups[0][0]
        assert s.reward == want and s.metadata["turn_rewards"] == [0.5, 1.0]
        assert s.metadata["termination"] == "env_done"


def test_reward_fn_scores_the_whole_trajectory():
    async def reward(sample: Sample) -> float:
        return float(sample.response.count("[obs"))

    strategy, _ = _strategy(
        ScriptEngine(lambda c, r: "go"),
        lambda: SleepyEnv(turns=3),
        env={"reward": "reward_fn"},
        reward_fn=reward,
    )
    s = asyncio.run(strategy(RolloutRequest(0))).groups[0][0]
    assert s.reward == 2.0


def test_step_timeout_and_episode_timeout_end_the_episode_keeping_its_turns():
    strategy, ctx = _strategy(
        ScriptEngine(lambda c, r: "go"), lambda: SleepyEnv(5.0), env={"step_timeout_s": 0.1}
    )
    started = time.perf_counter()
    result = asyncio.run(strategy(RolloutRequest(0)))
    s = result.groups[0][0]
    assert time.perf_counter() - started < 3
    assert s.metadata["termination"] == "timeout" and s.status is Status.TRUNCATED
    assert s.response == "go" and result.metrics["rollout/termination/timeout"] == 1.0
    ends = [e for e in ctx.sink.events if e.kind is EventKind.TURN_END]
    assert ends[-1].detail["status"] == "timeout"
    assert_episode_streams(ctx.sink.events)
    strategy, _ = _strategy(
        ScriptEngine(lambda c, r: "go"),
        lambda: SleepyEnv(0.05, turns=100),
        env={"episode_timeout_s": 0.3, "max_turns": 100},
    )
    s = asyncio.run(strategy(RolloutRequest(0))).groups[0][0]
    assert s.metadata["termination"] == "timeout" and s.response.count("go") >= 2


@pytest.mark.parametrize("on_abort", ["restart", "resume"])
def test_abort_mid_episode_hands_the_episode_back(on_abort):
    """batch_size 1 of 2 groups: p0 is fast, p1's second turn is slow. When p0 is kept, p1 is
    aborted mid-turn and handed back — reset (restart) or with its turns (resume) — counted,
    its attempt closed exactly once; a resumed episode continues with its live environment."""
    SleepyEnv.closed = 0

    def delay(conv: str, request) -> float:
        return 5.0 if conv.startswith("p1:") and "[obs" in conv else 0.0

    engine = ScriptEngine(lambda c, r: "abcdefgh", delay_s=delay)
    config = {"partial_rollout": True} if on_abort == "resume" else {}
    strategy, ctx = _strategy(
        engine,
        lambda: SleepyEnv(0.0, turns=3),
        prompts=["p0:", "p1:"],
        batch_size=1,
        over_sampling_batch_size=2,
        env={"on_abort": on_abort},
        **config,
    )
    started = time.perf_counter()
    result = asyncio.run(strategy(RolloutRequest(0)))
    assert time.perf_counter() - started < 4.5  # the abort cut the 5 s turn short
    assert [g[0].prompt for g in result.groups] == ["p0:"]
    assert result.metrics["rollout/aborted"] == 1.0 and result.metrics["rollout/returned_groups"] == 1.0
    (back,) = ctx.data_source.buffer
    s = back[0]
    ends = [
        e for e in ctx.sink.events if e.kind is EventKind.ATTEMPT_END and e.sample_index == s.sample_index
    ]
    assert len(ends) == 1 and ends[0].detail["status"] == "aborted"
    if on_abort == "restart":  # back to a fresh prompt: no turns, no episode state
        assert s.status is Status.PENDING and s.response_length == 0 and s.tokens == [112, 49, 58]
        assert not {"segments", "agentic", "termination"} & set(s.metadata)
        assert SleepyEnv.closed == 2
        return
    assert s.status is Status.ABORTED and s.metadata["termination"] == "aborted"
    assert s.response == "abcdefgh[obs 1]abcd"  # turn 1, its observation, half of turn 2
    s.validate()
    assert SleepyEnv.closed == 1  # the aborted episode's env is parked, not closed
    engine.delay_s = 0.0
    result = asyncio.run(strategy(RolloutRequest(1)))
    resumed = result.groups[0][0]
    assert resumed.prompt == "p1:" and resumed.status is Status.COMPLETED
    assert resumed.metadata["termination"] == "env_done"
    assert resumed.response.startswith("abcdefgh[obs 1]abcd")  # the turns so far were kept
    assert resumed.weight_versions == [0, 0, 0, 0]  # turn 1, half of turn 2, its resumption, turn 3
    assert resumed.response == "abcdefgh[obs 1]abcdabcdefgh[obs 2]abcdefgh"
    resumed.validate()
    assert (
        SleepyEnv.closed == 2 and not strategy.generate_fn._parked
    )  # the parked env was reused, then closed


def test_mask_offpolicy_masks_turns_from_older_weights():
    engine = ScriptEngine(lambda c, r: "go")
    versions = iter([0, 0, 1])

    orig = engine.generate

    async def generate(request):
        engine.weight_version = next(versions)
        return await orig(request)

    engine.generate = generate
    strategy, _ = _strategy(
        engine, lambda: SleepyEnv(turns=3), partial_rollout=True, mask_offpolicy_in_partial_rollout=True
    )
    result = asyncio.run(strategy(RolloutRequest(0)))
    s = result.groups[0][0]
    assert s.weight_versions == [0, 0, 1]
    model = [g for g in s.metadata["segments"] if g["source"] == "model"]
    assert [g["trainable"] for g in model] == [False, False, True]
    assert sum(s.effective_loss_mask()) == 2  # only the last "go"
    assert result.metrics["rollout/masked_model_tokens_frac"] == pytest.approx(4 / 6)


def test_a_generate_function_returning_several_samples_is_refused():
    from inference_testkit import ToyEngine, make_context

    class PerTurn:
        async def __call__(self, inp):
            return [inp.sample.clone(), inp.sample.clone()]

    ctx = make_context(ToyEngine())
    strategy = InferenceRollout(ctx)
    strategy.generate_fn = PerTurn()
    with pytest.raises(GenerateContractError, match=r"exactly one Sample per input sample.*append_turn"):
        asyncio.run(strategy(RolloutRequest(0)))
    assert ctx.data_source.returned_groups >= 1  # nothing lost


def test_env_config_problems_are_reported_with_their_keys():
    config = RolloutConfig(
        env={
            "type": "tools",
            "options": {"tools": ["x:y"], "tool_timeout_s": -1, "bogus": 1},
            "on_abort": "resume",
        },
        generate_function_path="pkg.mod:gen",
    )
    with pytest.raises(ConfigError) as err:
        validate_rollout_config(config, {})
    keys = {p.key for p in err.value.problems}
    assert {
        "rollout.env.options.tool_timeout_s",
        "rollout.env.options.bogus",
        "rollout.env.on_abort",
        "rollout.generate_function_path",
    } <= keys
    with pytest.raises(
        ConfigError, match=r"rollout.env.type: unknown environment 'nope'; built-ins: \[.*'tools'.*\]"
    ):
        validate_rollout_config(RolloutConfig(env={"type": "nope"}), {})


def test_strategies_declare_multi_turn_env_and_legacy_is_refused():
    from verst.rollout.strategies.fully_async import FullyAsyncRollout

    assert Capability.MULTI_TURN_ENV in InferenceRollout.capabilities
    assert Capability.MULTI_TURN_ENV in FullyAsyncRollout.capabilities
    from verst.rollout_legacy.strategy import LegacyRolloutStrategy

    assert Capability.MULTI_TURN_ENV not in LegacyRolloutStrategy.capabilities
    with pytest.raises(ConfigError, match=r"rollout.env: .*does not support multi_turn_env"):
        validate_rollout_config(RolloutConfig(env={"type": "tools"}), {"VERST_USE_LEGACY_ROLLOUT_V1": "1"})


def test_semaphore_scope_episode_is_the_baseline_that_serialises_tool_waits():
    gen = AgenticGenerate.__new__(AgenticGenerate)
    AgenticGenerate.__init__(gen, RolloutConfig(env={}).env, lambda: SleepyEnv(), semaphore_scope="episode")
    assert gen.acquires_semaphore is False
    assert AgenticGenerate.acquires_semaphore is True


def test_fully_async_runs_episodes():
    from inference_testkit import ListDataSource

    from verst.rollout.strategies.fully_async import FullyAsyncRollout

    engine = ScriptEngine(lambda c, r: "go")
    ctx = context(
        engine,
        prompts=[f"p{i}:" for i in range(8)],
        env={"type": "tools"},
        fully_async=True,
        async_buffer_groups=2,
    )
    ctx.data_source = ListDataSource([f"p{i}:" for i in range(8)], 1)

    async def run():
        strategy = FullyAsyncRollout(ctx)
        strategy.generate_fn.factory = lambda: SleepyEnv(0.01, turns=2)
        try:
            a = await strategy(RolloutRequest(0))
            b = await strategy(RolloutRequest(1, weight_version=1))
        finally:
            await strategy.close()
        return a, b

    a, b = asyncio.run(run())
    for result in (a, b):
        (group,) = result.groups
        assert group[0].metadata["termination"] == "env_done" and group[0].reward == 1.0
        group[0].validate()
        assert result.metrics["rollout/turns_mean"] == 2


def test_dynamic_filters_see_finished_episodes():
    """nonzero_std over episodes: groups whose episodes all got the same env reward are dropped
    and counted; the others are kept."""
    rewards = iter([1.0, 1.0, 0.0, 1.0] * 4)
    strategy, _ = _strategy(
        ScriptEngine(lambda c, r: "go"),
        lambda: SleepyEnv(turns=1, reward=next(rewards)),
        batch_size=1,
        n_samples_per_prompt=2,
        dynamic_filters=["nonzero_std"],
    )
    result = asyncio.run(strategy(RolloutRequest(0)))
    (group,) = result.groups
    assert sorted(s.reward for s in group) == [0.0, 1.0]
    assert result.metrics["rollout/dropped/zero_std"] == 1.0
