"""Sample invariants and the to_dict/from_dict round trip."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from verst.rollout import Sample, SampleInvariantError, Status


@st.composite
def samples(draw):
    prompt_len = draw(st.integers(0, 8))
    response_length = draw(st.integers(0, 8))
    tokens = draw(
        st.lists(
            st.integers(0, 1000), min_size=prompt_len + response_length, max_size=prompt_len + response_length
        )
    )
    mask = draw(
        st.none() | st.lists(st.sampled_from([0, 1]), min_size=response_length, max_size=response_length)
    )
    logprobs = draw(
        st.none()
        | st.lists(st.floats(-50, 0, allow_nan=False), min_size=response_length, max_size=response_length)
    )
    reward = draw(
        st.none()
        | st.floats(-1, 1, allow_nan=False)
        | st.dictionaries(st.text(min_size=1, max_size=4), st.floats(-1, 1, allow_nan=False), max_size=3)
    )
    return Sample(
        prompt=draw(st.text(max_size=20)),
        label=draw(st.none() | st.text(max_size=5)),
        tokens=tokens,
        response_length=response_length,
        response=draw(st.text(max_size=20)),
        reward=reward,
        loss_mask=mask,
        rollout_logprobs=logprobs,
        status=draw(st.sampled_from(list(Status))),
        weight_versions=draw(st.lists(st.integers(0, 10), max_size=3)),
        metadata=draw(st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3)),
        generate_function_path=draw(st.none() | st.just("pkg.mod:fn")),
        group_index=draw(st.none() | st.integers(0, 100)),
        sample_index=draw(st.none() | st.integers(0, 100)),
    )


@given(samples())
def test_round_trip_and_valid(sample):
    sample.validate()
    assert Sample.from_dict(sample.to_dict()) == sample
    assert len(sample.effective_loss_mask()) == sample.response_length
    assert sample.prompt_length + sample.response_length == len(sample.tokens)


@given(samples(), st.integers(1, 3))
def test_wrong_mask_length_is_rejected(sample, extra):
    sample.loss_mask = [1] * (sample.response_length + extra)
    with pytest.raises(SampleInvariantError, match="loss_mask"):
        sample.validate()


def test_wrong_logprob_length_and_response_length_are_rejected():
    with pytest.raises(SampleInvariantError, match="rollout_logprobs"):
        Sample(tokens=[1, 2, 3], response_length=2, rollout_logprobs=[0.0]).validate()
    with pytest.raises(SampleInvariantError, match="response_length"):
        Sample(tokens=[1], response_length=2).validate()


def test_unknown_field_in_from_dict_is_named():
    with pytest.raises(ValueError, match="bogus"):
        Sample.from_dict({"bogus": 1})


def test_dict_reward_needs_a_key():
    s = Sample(reward={"acc": 1.0, "fmt": 0.5})
    assert s.scalar_reward("fmt") == 0.5
    with pytest.raises(SampleInvariantError, match="reward_key"):
        s.scalar_reward(None)


def _containers(obj, seen=None):
    """The ids of every list, dict and set reachable from `obj` (its mutable state)."""
    seen = set() if seen is None else seen
    values = obj.__dict__.values() if isinstance(obj, Sample) else obj
    if isinstance(obj, dict):
        values = [*obj.keys(), *obj.values()]
    for v in values:
        if isinstance(v, list | dict | set) and id(v) not in seen:
            seen.add(id(v))
            _containers(v, seen)
    return seen


@given(samples())
def test_clone_equals_deepcopy_and_shares_no_mutable_state(sample):
    import copy

    sample.metadata["nested"] = {"ids": [1, 2], "rows": [{"a": [3]}]}
    sample.images = [{"path": "x.png", "shapes": [[1, 2]]}]
    clone, deep = sample.clone(), copy.deepcopy(sample)
    assert clone == deep == sample
    assert type(clone) is Sample and clone.__dict__.keys() == deep.__dict__.keys()
    assert not _containers(clone) & _containers(sample)  # nothing mutable is aliased
    clone.tokens.append(7)
    clone.metadata["nested"]["ids"].append(9)
    assert sample.tokens != clone.tokens and sample.metadata["nested"]["ids"] == [1, 2]


def test_clone_keeps_objects_shared_between_fields_shared_as_deepcopy_does():
    import copy

    shared_list, shared_dict = [1, 2], {"k": 1}
    s = Sample(tokens=shared_list, metadata={"same": shared_list, "d": shared_dict, "again": shared_dict})
    s.metadata["me"] = s  # a cycle back to the sample itself
    for c in (s.clone(), copy.deepcopy(s)):
        assert c.tokens is c.metadata["same"] and c.tokens is not shared_list
        assert c.metadata["d"] is c.metadata["again"] and c.metadata["d"] is not shared_dict
        assert c.metadata["me"] is c


def test_clone_of_a_subclass_is_its_deepcopy():
    class Tagged(Sample):
        pass

    s = Tagged(prompt="p", metadata={"x": [1]})
    c = s.clone()
    assert type(c) is Tagged and c == s and c.metadata["x"] is not s.metadata["x"]
