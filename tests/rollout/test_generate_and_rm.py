"""`generate_and_rm` / `generate_and_rm_group`: lifecycle contract, abort, failures, overrides."""

from __future__ import annotations

import asyncio

import pytest
from inference_testkit import (
    EchoGenerate,
    ToyEngine,
    assert_attempts_closed,
    attempt_streams,
    make_context,
)

from verst.rollout.engine import SamplingParams
from verst.rollout.generate import (
    GroupGenerationError,
    SingleTurnGenerate,
    generate_and_rm,
    generate_and_rm_group,
)
from verst.rollout.lifecycle import EventKind
from verst.rollout.protocols import GenerateState
from verst.rollout.sample import Sample, Status
from verst.rollout.sampling import derive_sample_seed, sampling_params_for

FULL = ["attempt_start", "gen_start", "gen_end", "attempt_end"]


def make_state(ctx, rollout_id: int = 0, concurrency: int = 8) -> GenerateState:
    return GenerateState(
        context=ctx, rollout_id=rollout_id, weight_version=3, semaphore=asyncio.Semaphore(concurrency)
    )


def prompt_sample(i: int = 0, text: str = "hello") -> Sample:
    return Sample(prompt=text, label="x", group_index=0, sample_index=i)


def ends(ctx) -> list:
    return [e for e in ctx.sink.events if e.kind is EventKind.ATTEMPT_END]


async def test_success_lifecycle_order_and_sample_contents():
    ctx = make_context()
    state = make_state(ctx)
    s = await generate_and_rm(state, prompt_sample(), sampling_params_for(ctx.config))
    assert [e.kind.value for e in ctx.sink.events] == FULL
    assert all(e.weight_version == 3 and e.rollout_id == 0 and e.sample_index == 0 for e in ctx.sink.events)
    assert ends(ctx)[0].detail["status"] == "completed"
    assert s.status is Status.COMPLETED
    prompt_ids = [ord(c) for c in "hello"]
    assert s.tokens[: len(prompt_ids)] == prompt_ids and s.prompt_length == len(prompt_ids)
    assert s.response_length == len(s.rollout_logprobs) > 0 and s.loss_mask is None
    assert s.weight_versions == [0] and s.reward == float(s.response_length % 2 == 0)
    assert ctx.engine.requests[0].rid == "r0-0-0"
    s.validate()


async def test_finished_sample_returned_untouched():
    ctx = make_context()
    s = Sample(prompt="p", tokens=[1, 2], response_length=1, status=Status.TRUNCATED, reward=0.5)
    before = s.to_dict()
    assert await generate_and_rm(make_state(ctx), s, SamplingParams()) is s
    assert s.to_dict() == before and ctx.sink.events == [] and ctx.engine.requests == []


async def test_abort_flag_marks_aborted_without_generating():
    ctx = make_context()
    state = make_state(ctx)
    state.aborted.set()
    s = await generate_and_rm(state, prompt_sample(), SamplingParams())
    assert s.status is Status.ABORTED and ctx.engine.requests == []
    assert [e.kind.value for e in ctx.sink.events] == ["attempt_start", "attempt_end"]
    assert ends(ctx)[0].detail["status"] == "aborted"


async def test_engine_abort_mid_generation_keeps_partial_tokens():
    ctx = make_context(ToyEngine(length=lambda r: 50, token_delay_s=0.002))
    state = make_state(ctx, rollout_id=4)
    task = asyncio.create_task(generate_and_rm(state, prompt_sample(), sampling_params_for(ctx.config)))
    await asyncio.sleep(0.02)
    await ctx.engine.abort("r4-")
    s = await task
    assert s.status is Status.ABORTED and 0 < s.response_length < 50
    assert s.metadata["start_rollout_id"] == 4 and s.reward is None
    assert [e.kind.value for e in ctx.sink.events] == FULL
    assert ends(ctx)[0].detail["status"] == "aborted"
    s.validate()


async def test_exception_propagates_and_attempt_end_fires_once():
    boom = RuntimeError("engine exploded")
    ctx = make_context(ToyEngine(fail=lambda r: boom))
    with pytest.raises(RuntimeError) as info:
        await generate_and_rm(make_state(ctx), prompt_sample(), SamplingParams())
    assert info.value is boom
    assert [e.kind.value for e in ctx.sink.events] == ["attempt_start", "gen_start", "attempt_end"]
    assert ends(ctx)[0].detail["error"] == "RuntimeError"
    assert "engine exploded" in ends(ctx)[0].detail["message"]


async def test_sibling_cancellation_closes_every_attempt():
    def fail(req):
        return ValueError("bad sample") if req.rid.startswith("r0-2-") else None

    ctx = make_context(ToyEngine(length=lambda r: 200, token_delay_s=0.005, fail=fail))
    group = [prompt_sample(i) for i in range(4)]
    with pytest.raises(GroupGenerationError) as info:
        await generate_and_rm_group(make_state(ctx), group, SamplingParams(max_new_tokens=500))
    err = info.value
    assert isinstance(err.cause, ValueError) and err.group is group and err.__cause__ is err.cause
    assert_attempts_closed(ctx.sink)
    streams = attempt_streams(ctx.sink)
    assert sorted(streams) == [0, 1, 2, 3]
    assert all(kinds.count("attempt_end") == 1 for kinds in streams.values())
    by_index = {e.sample_index: e.detail for e in ends(ctx)}
    assert by_index[2]["error"] == "ValueError"
    assert {by_index[i]["status"] for i in (0, 1, 3)} == {"cancelled"}
    assert {by_index[i]["error"] for i in (0, 1, 3)} == {"CancelledError"}


class _Interrupt(BaseException):
    """Stands in for KeyboardInterrupt / a test runner's timeout: not an `Exception`."""


async def test_base_exceptions_in_a_group_are_not_retried_as_group_failures():
    def fail(req):
        return _Interrupt() if req.rid.startswith("r0-1-") else None

    ctx = make_context(ToyEngine(length=lambda r: 50, token_delay_s=0.001, fail=fail))
    with pytest.raises(BaseExceptionGroup) as info:
        await generate_and_rm_group(make_state(ctx), [prompt_sample(i) for i in range(3)], SamplingParams())
    assert not isinstance(info.value, GroupGenerationError)
    assert info.value.subgroup(_Interrupt) is not None
    assert_attempts_closed(ctx.sink)


async def test_outer_cancellation_also_closes_attempts():
    ctx = make_context(ToyEngine(length=lambda r: 1000, token_delay_s=0.01))
    task = asyncio.create_task(
        generate_and_rm_group(
            make_state(ctx), [prompt_sample(i) for i in range(3)], SamplingParams(max_new_tokens=2000)
        )
    )
    await asyncio.sleep(0.03)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert_attempts_closed(ctx.sink)
    assert len(ends(ctx)) == 3


async def test_attempt_start_is_emitted_before_the_semaphore_wait():
    ctx = make_context()
    state = make_state(ctx, concurrency=1)
    await state.semaphore.acquire()
    task = asyncio.create_task(generate_and_rm(state, prompt_sample(), SamplingParams()))
    await asyncio.sleep(0.01)
    assert [e.kind.value for e in ctx.sink.events] == ["attempt_start"]
    state.semaphore.release()
    await task
    assert [e.kind.value for e in ctx.sink.events] == FULL


async def test_evaluation_emits_nothing_even_on_failure():
    ctx = make_context()
    await generate_and_rm(make_state(ctx), prompt_sample(), SamplingParams(), evaluation=True)
    ctx.engine.fail = lambda r: RuntimeError("x")
    with pytest.raises(GroupGenerationError):
        await generate_and_rm_group(
            make_state(ctx), [prompt_sample(0), prompt_sample(1)], SamplingParams(), True
        )
    assert ctx.sink.events == []


async def test_per_sample_generate_override_is_loaded_once_and_used_only_for_that_sample():
    ctx = make_context()
    state = make_state(ctx)
    overridden = [prompt_sample(i) for i in range(3)]
    for s in overridden:
        s.generate_function_path = "inference_testkit:EchoGenerate"
    v1 = prompt_sample(7)
    v1.generate_function_path = "inference_testkit:v1_style_echo"
    plain = prompt_sample(9)
    out = await generate_and_rm_group(state, [*overridden, v1, plain], sampling_params_for(ctx.config))
    assert [s.metadata.get("generated_by") for s in out] == ["echo", "echo", "echo", None, None]
    assert out[0].response == "olleh"
    assert out[3].response == "v1" and out[3].metadata["v1_max_new_tokens"] == ctx.config.max_response_len
    assert out[3].metadata["v1_n"] == ctx.config.n_samples_per_prompt
    echo = state.generate_fn_cache["inference_testkit:EchoGenerate"]
    assert isinstance(echo, EchoGenerate) and echo.calls == 3
    assert [r.rid for r in ctx.engine.requests] == ["r0-9-0"]
    assert isinstance(state.generate_fn, SingleTurnGenerate)


async def test_sampling_params_are_copied_and_seeded_per_sample():
    ctx = make_context(seed=11)
    params = sampling_params_for(ctx.config)
    state = make_state(ctx, rollout_id=2)
    await generate_and_rm_group(state, [prompt_sample(i) for i in range(3)], params)
    seeds = [r.sampling.sampling_seed for r in ctx.engine.requests]
    assert seeds == [derive_sample_seed(11, 2, i, 0) for i in range(3)]
    assert len(set(seeds)) == 3 and params.sampling_seed == 11
    assert all(r.sampling is not params for r in ctx.engine.requests)


async def test_eval_sampling_params_use_eval_settings():
    ctx = make_context(temperature=0.9, max_response_len=64, eval={"temperature": 0.0, "max_response_len": 8})
    p = sampling_params_for(ctx.config, evaluation=True)
    assert (p.temperature, p.max_new_tokens) == (0.0, 8)
    assert sampling_params_for(ctx.config).max_new_tokens == 64


async def test_reward_error_marks_sample_failed():
    async def bad_reward(sample):
        raise KeyError("no such label")

    ctx = make_context(reward_fn=bad_reward)
    s = await generate_and_rm(make_state(ctx), prompt_sample(), SamplingParams())
    assert s.status is Status.FAILED and s.reward is None
    assert s.metadata["error"].startswith("reward: KeyError:")
    assert ends(ctx)[0].detail["status"] == "failed"


async def test_group_reward_replaces_per_sample_reward():
    per_sample_calls = []

    async def per_sample(sample):
        per_sample_calls.append(sample)
        return 0.0

    async def rank(samples):
        return [float(i) for i in range(len(samples))]

    ctx = make_context(reward_fn=per_sample, reward={"group": True})
    ctx.group_reward_fn = rank
    out = await generate_and_rm_group(make_state(ctx), [prompt_sample(i) for i in range(3)], SamplingParams())
    assert [s.reward for s in out] == [0.0, 1.0, 2.0] and per_sample_calls == []


async def test_resume_aborted_sample_masks_offpolicy_part():
    ctx = make_context(partial_rollout=True, mask_offpolicy_in_partial_rollout=True, max_response_len=10)
    ctx.engine.weight_version = 5
    s = prompt_sample(1)
    s.tokens = [ord(c) for c in "hello"] + [70, 71, 72]
    s.response_length, s.response, s.rollout_logprobs = 3, "FGH", [-1.0, -1.0, -1.0]
    s.status, s.weight_versions, s.metadata = Status.ABORTED, [4], {"start_rollout_id": 2, "attempt": 0}
    out = await generate_and_rm(make_state(ctx, rollout_id=3), s, sampling_params_for(ctx.config))
    req = ctx.engine.requests[0]
    assert req.input_ids[-3:] == [70, 71, 72] and req.sampling.max_new_tokens == 7
    assert req.rid == "r3-1-1"
    n_new = out.response_length - 3
    assert n_new > 0 and out.loss_mask == [0, 0, 0] + [1] * n_new
    assert out.rollout_logprobs[:3] == [-1.0] * 3 and len(out.rollout_logprobs) == out.response_length
    assert out.weight_versions == [4, 5] and out.response.startswith("FGH")
    out.validate()


async def test_context_length_bounds_max_new_tokens():
    ctx = make_context(max_context_len=7, max_response_len=100)
    ctx.engine.length = lambda r: 100
    s = await generate_and_rm(make_state(ctx), prompt_sample(text="hello"), sampling_params_for(ctx.config))
    assert ctx.engine.requests[0].sampling.max_new_tokens == 2
    assert s.status is Status.TRUNCATED and len(s.tokens) == 7


async def test_chat_template_applied_when_configured():
    ctx = make_context(data={"apply_chat_template": True})
    s = await generate_and_rm(make_state(ctx), prompt_sample(text="hi"), SamplingParams())
    assert ctx.engine.requests[0].input_ids == [ord(c) for c in "<user>hi<assistant>"]
    assert s.prompt_length == len("<user>hi<assistant>")
