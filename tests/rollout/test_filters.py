"""Dynamic filters: built-ins (property-tested), loading by name and by import path."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.rollout.importing import ImportPathError
from verst.rollout.sample import Sample, Status
from verst.rollout.strategies.filters import (
    BUILTIN_FILTERS,
    FilterOutcome,
    apply_filters,
    load_dynamic_filter,
)

rewards = st.one_of(st.integers(-3, 3).map(float), st.floats(-1e6, 1e6, allow_nan=False))
statuses = st.sampled_from(list(Status))


def group_of(values, status=Status.COMPLETED, key=None):
    return [Sample(reward={key: v} if key else v, status=status) for v in values]


@settings(deadline=None, max_examples=60)
@given(st.lists(rewards, min_size=1, max_size=16), st.sampled_from([None, "acc"]))
def test_nonzero_std_keeps_exactly_the_groups_with_distinct_rewards(values, key):
    outcome = load_dynamic_filter("nonzero_std", key)(group_of(values, key=key))
    assert outcome.keep == (len(set(values)) > 1)
    assert outcome.reason == (None if outcome.keep else "zero_std")


@settings(deadline=None, max_examples=60)
@given(st.lists(statuses, min_size=1, max_size=16))
def test_no_aborted_drops_exactly_the_groups_with_an_aborted_sample(sts):
    group = [Sample(status=s, reward=0.0) for s in sts]
    outcome = load_dynamic_filter("no_aborted")(group)
    assert outcome.keep == (Status.ABORTED not in sts)
    assert outcome.reason == (None if outcome.keep else "aborted")


@settings(deadline=None, max_examples=60)
@given(st.lists(rewards, min_size=1, max_size=8), st.lists(statuses, min_size=1, max_size=8))
def test_chain_is_the_first_rejection(values, sts):
    group = [Sample(reward=v, status=s) for v, s in zip(values, sts, strict=False)]
    filters = [load_dynamic_filter(n) for n in ("no_aborted", "nonzero_std")]
    outcome = apply_filters(filters, group)
    expected = next((o for o in (f(group) for f in filters) if not o.keep), FilterOutcome(True))
    assert outcome == expected


def test_samples_without_reward_are_left_out_of_the_std():
    group = [Sample(reward=1.0), Sample(reward=0.0), Sample(reward=None, status=Status.ABORTED)]
    assert load_dynamic_filter("nonzero_std")(group).keep


def user_filter_bool(group):
    return len(group) > 1


class UserFilterClass:
    def __init__(self, reward_key=None):
        self.reward_key = reward_key

    def __call__(self, group):
        return FilterOutcome(False, f"custom_{self.reward_key}")


def test_builtin_table_and_user_filters_by_path():
    assert set(BUILTIN_FILTERS) == {"nonzero_std", "no_aborted"}
    by_bool = load_dynamic_filter("test_filters:user_filter_bool")
    assert by_bool([Sample(), Sample()]).keep
    assert by_bool([Sample()]) == FilterOutcome(False, "user_filter_bool")
    assert load_dynamic_filter("test_filters:UserFilterClass", "acc")([]) == FilterOutcome(
        False, "custom_acc"
    )


def test_unknown_filter_names_the_choices():
    with pytest.raises(ValueError, match="nonzero_std"):
        load_dynamic_filter("nonzero")
    with pytest.raises(ImportPathError, match="not installed"):
        load_dynamic_filter("no_such_pkg.filters:f")
