"""`verst replay`'s comparison (`compare_states`): bit equality over nested train states.

Invariants over random states: a state equals its clone; changing one element of one tensor is
reported as exactly that entry with exactly that max abs diff; bit-level differences that `==`
misses (-0.0 vs 0.0) count; missing entries and changed plain values are named.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.trainer.run.replay import _flatten, compare_states

shapes = st.lists(st.integers(1, 5), min_size=0, max_size=3)


@st.composite
def states(draw):
    n = draw(st.integers(1, 6))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    tensors = {f"w{i}": torch.randn(tuple(draw(shapes)), generator=gen) for i in range(n)}
    return {"model": tensors, "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "lr": [1e-3]}}


@settings(max_examples=50, deadline=None)
@given(states())
def test_a_state_equals_its_clone(state):
    flat = _flatten(state)
    clone = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in flat.items()}
    report = compare_states(flat, clone, 1)
    assert report.equal and report.compared == len(flat)


@settings(max_examples=50, deadline=None)
@given(states(), st.data(), st.floats(1e-6, 10.0))
def test_one_changed_element_is_named_with_its_diff(state, data, delta):
    flat = _flatten(state)
    name = data.draw(st.sampled_from(sorted(k for k in flat if k.startswith("model/"))))
    other = dict(flat)
    other[name] = flat[name].clone()
    index = data.draw(st.integers(0, flat[name].numel() - 1))
    other[name].view(-1)[index] += delta
    expected = (other[name].double() - flat[name].double()).abs().max().item()
    report = compare_states(flat, other, 2)
    if expected == 0.0:  # delta below the float32 spacing there: no change at all
        assert report.equal
        return
    assert [d.name for d in report.diffs] == [name]
    assert report.diffs[0].max_abs_diff == expected


def test_negative_zero_missing_entries_and_plain_values_count():
    a = {"z": torch.tensor([0.0]), "only_a": torch.ones(1), "lr": 1e-3}
    b = {"z": torch.tensor([-0.0]), "lr": 2e-3}
    names = {d.name: d for d in compare_states(a, b, 3).diffs}
    assert set(names) == {"z", "only_a", "lr"}
    assert names["only_a"].why == "only in the replay"
    assert "0.001 vs 0.002" in names["lr"].why
