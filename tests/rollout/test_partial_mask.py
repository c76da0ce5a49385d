"""Property tests of the partial-rollout loss-mask arithmetic (`resumed_loss_mask`)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.rollout.generate import resumed_loss_mask

masks = st.one_of(st.none(), st.lists(st.integers(0, 1), max_size=40))


def expand(mask: list[int] | None, n: int) -> list[int]:
    return [1] * n if mask is None else mask


@settings(deadline=None, max_examples=60)
@given(prev=masks, new_len=st.integers(0, 40), offpolicy=st.booleans())
def test_resumed_mask_invariants(prev, new_len, offpolicy):
    prev_len = 7 if prev is None else len(prev)
    out = expand(resumed_loss_mask(prev, prev_len, new_len, mask_offpolicy=offpolicy), prev_len + new_len)
    assert len(out) == prev_len + new_len
    assert set(out) <= {0, 1}
    assert out[prev_len:] == [1] * new_len, "tokens generated now are always trained on"
    if offpolicy:
        assert out[:prev_len] == [0] * prev_len, "earlier (off-policy) tokens are masked"
    else:
        assert out[:prev_len] == expand(prev, prev_len), "without masking the earlier mask is kept"


@settings(deadline=None, max_examples=60)
@given(prev=masks, new_len=st.integers(0, 40), offpolicy=st.booleans())
def test_none_means_all_ones(prev, new_len, offpolicy):
    prev_len = 5 if prev is None else len(prev)
    out = resumed_loss_mask(prev, prev_len, new_len, mask_offpolicy=offpolicy)
    assert (out is None) == all(expand(out, prev_len + new_len))


@settings(deadline=None, max_examples=60)
@given(segments=st.lists(st.integers(0, 10), min_size=1, max_size=6), offpolicy=st.booleans())
def test_repeated_resumes_only_keep_the_last_segment_when_masking(segments, offpolicy):
    mask, length = None, 0
    for n in segments:
        mask = resumed_loss_mask(mask, length, n, mask_offpolicy=offpolicy and length > 0)
        length += n
    out = expand(mask, length)
    last = segments[-1]
    if offpolicy:
        assert out == [0] * (length - last) + [1] * last
    else:
        assert out == [1] * length


def test_wrong_previous_mask_length_is_an_error():
    with pytest.raises(ValueError, match="2 entries for 3 tokens"):
        resumed_loss_mask([1, 1], 3, 1, mask_offpolicy=False)
