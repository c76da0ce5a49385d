"""The trajectory contract: one sample per episode, built only by `append_turn`.

Properties over random turn sequences: tokens / loss mask / log-probs stay aligned, `validate`
holds, and — through the real episode loop — every token the engine saw or produced is exactly
the token the trainer will score (no detokenise → retokenise round trip).
"""

from __future__ import annotations

import asyncio

import pytest
from agentic_testkit import TOKENIZER, ScriptEngine, context
from hypothesis import example, given, settings
from hypothesis import strategies as st

from verst.rollout.agentic import (
    MASKED_LOGPROB,
    ModelTurn,
    StepResult,
    append_turn,
    mask_turns_before,
    model_token_positions,
    segments_of,
)
from verst.rollout.protocols import RolloutRequest
from verst.rollout.sample import Sample, SampleInvariantError
from verst.rollout.strategies.inference import InferenceRollout

turns = st.lists(
    st.tuples(
        st.booleans(),  # model turn?
        st.lists(st.integers(0, 127), min_size=0, max_size=6),
        st.booleans(),  # trainable (model turns)
        st.integers(0, 3),  # weight version
    ),
    max_size=8,
)


@settings(max_examples=100, deadline=None)
@given(prompt=st.lists(st.integers(0, 127), min_size=1, max_size=5), seq=turns)
def test_append_turn_keeps_tokens_mask_and_logprobs_aligned(prompt, seq):
    s = Sample(tokens=list(prompt))
    expected_tokens, expected_mask, expected_lp, versions = list(prompt), [], [], []
    for is_model, ids, trainable, version in seq:
        if is_model:
            lps = [-0.5 - i for i in range(len(ids))]
            append_turn(s, ids, lps, trainable, version)
            expected_mask += [int(trainable)] * len(ids)
            expected_lp += lps
            versions.append(version)
        else:
            append_turn(s, ids, None, False)
            expected_mask += [0] * len(ids)
            expected_lp += [MASKED_LOGPROB] * len(ids)
        expected_tokens += ids
    s.validate()
    assert s.tokens == expected_tokens
    assert s.prompt_length == len(prompt)
    assert s.effective_loss_mask() == expected_mask
    assert s.weight_versions == versions
    if s.response_length:
        assert s.rollout_logprobs == expected_lp
    positions = model_token_positions(s)
    assert all(expected_mask[i] == 0 for i in range(s.response_length) if i not in set(positions))
    if s.response_length:  # per-token versions: a model token's own, an injected one's predecessor
        assert len(s.token_versions) == s.response_length
        last = -1
        for seg in segments_of(s):
            want = seg["weight_version"] if seg["source"] == "model" else last
            assert s.token_versions[seg["start"] : seg["start"] + seg["length"]] == [want] * seg["length"]
            last = seg["weight_version"] if seg["source"] == "model" and seg["length"] else last


@settings(max_examples=50, deadline=None)
@given(seq=turns, cut=st.integers(0, 3))
# an empty model turn at a newer version lends its version to no injected token (found by hypothesis)
@example(seq=[(True, [0], True, 0), (True, [], True, 1), (False, [0], True, 0)], cut=0)
def test_mask_turns_before_masks_exactly_older_model_turns(seq, cut):
    s = Sample(tokens=[1])
    for is_model, ids, _, version in seq:
        if is_model:
            append_turn(s, ids, [-1.0] * len(ids), True, version)
        else:
            append_turn(s, ids, None, False)
    mask_turns_before(s, cut)
    s.validate()
    if s.response_length:  # the same tokens as the single-turn rule (offpolicy_loss_mask) masks
        from verst.rollout.generate import offpolicy_loss_mask

        model = [seg for seg in segments_of(s) if seg["source"] == "model" and seg["length"]]
        newest = max((seg["weight_version"] for seg in model), default=None)
        if newest is not None and cut == newest:
            env_zero = [
                0 if seg["source"] == "env" else 1 for seg in segments_of(s) for _ in range(seg["length"])
            ]
            by_version = offpolicy_loss_mask(env_zero, s.token_versions) or [1] * s.response_length
            assert s.effective_loss_mask() == by_version
    mask = s.effective_loss_mask()
    for seg in segments_of(s):
        span = mask[seg["start"] : seg["start"] + seg["length"]]
        want = int(seg["source"] == "model" and seg["weight_version"] >= cut)
        assert span == [want] * seg["length"]


def test_validate_names_a_trainable_injected_token():
    s = Sample(tokens=[1])
    append_turn(s, [5, 6], [-1.0, -1.0], True, 0)
    append_turn(s, [7, 8], None, False)
    s.loss_mask[2] = 1
    with pytest.raises(SampleInvariantError, match=r"env.*loss mask 1 on injected"):
        s.validate()
    s.loss_mask[2] = 0
    s.metadata["segments"][1]["start"] = 3
    with pytest.raises(SampleInvariantError, match="contiguous"):
        s.validate()


def test_append_turn_refuses_bad_turns():
    s = Sample(tokens=[1])
    with pytest.raises(ValueError, match="never trainable"):
        append_turn(s, [1], None, True, source="env")
    with pytest.raises(ValueError, match="2 log-probs for 1 ids"):
        append_turn(s, [1], [-1.0, -2.0], True, 0)
    with pytest.raises(ValueError, match="weight_version"):
        append_turn(s, [1], [-1.0], True)


class EchoEnv:
    """Replies the scripted observations in order, then ends the episode."""

    def __init__(self, observations: list[str]) -> None:
        self.observations = list(observations)

    async def reset(self, sample):
        return None

    async def step(self, turn: ModelTurn) -> StepResult:
        if not self.observations:
            return StepResult(done=True, reward=1.0)
        return StepResult(observation=self.observations.pop(0), reward=0.0)

    async def close(self):
        pass


text = st.text(alphabet="abcxyz0123 <>/", min_size=1, max_size=8)


@settings(max_examples=25, deadline=None)
@given(replies=st.lists(text, min_size=1, max_size=5), observations=st.lists(text, max_size=4))
def test_the_engine_saw_exactly_the_tokens_that_are_trained_on(replies, observations):
    engine = ScriptEngine(lambda conv, req: replies[len(engine.requests) % len(replies)])
    ctx = context(engine, prompts=["q:"], env={"type": "tools", "max_turns": 6})
    strategy = InferenceRollout(ctx)
    strategy.generate_fn.factory = lambda: EchoEnv(observations)
    sample = asyncio.run(strategy(RolloutRequest(0))).groups[0][0]
    sample.validate()
    mask = sample.effective_loss_mask()
    prompt_len = sample.prompt_length
    for request, out in zip(engine.requests, engine.outputs, strict=True):
        n = len(request.input_ids)
        assert sample.tokens[:n] == request.input_ids  # what the engine saw is the trained prefix
        got = sample.tokens[n : n + len(out.output_ids)]
        assert got == out.output_ids  # what it produced is trained as is
        r = n - prompt_len
        assert mask[r : r + len(got)] == [1] * len(got)
        assert sample.rollout_logprobs[r : r + len(got)] == out.output_logprobs
    model = set(model_token_positions(sample))
    assert all(mask[i] == 0 for i in range(sample.response_length) if i not in model)
    assert len(model) == sum(len(o.output_ids) for o in engine.outputs)
    assert TOKENIZER.decode(sample.tokens) == "q:" + sample.response
    assert sample.reward == 1.0  # the env's final reward
    assert sample.metadata["turn_rewards"][-1] == 1.0
