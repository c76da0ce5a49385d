"""Prompt lookup (`speculative/ngram.py`): what a lookup proposes; and the ragged verify's LM
head (`speculative/ragged._head`)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from verst.rollout.engines.embedded.speculative.ngram import NgramIndex


def _index(tokens: list[int]) -> NgramIndex:
    idx = NgramIndex()
    idx.extend(tokens, [])
    return idx


def test_lookup_proposes_what_followed_the_latest_longest_match():
    idx = _index([5, 6, 7, 8, 9, 1, 6, 7])
    assert idx.lookup(1, 3, 3) == [8, 9, 1]
    assert idx.lookup(1, 3, 1) == [8]
    assert _index([5, 6, 7]).lookup(1, 3, 4) == []  # 7 never occurred before


def test_a_loop_shorter_than_k_is_proposed_k_long():
    assert _index([3, 4, 9, 9, 9]).lookup(1, 3, 4) == [9, 9, 9, 9]  # period 1
    assert _index([3, 1, 2, 1, 2]).lookup(1, 3, 5) == [1, 2, 1, 2, 1]  # period 2
    # the continuation reaches the end: the period repeats from there
    assert _index([7, 1, 2, 3, 1, 2, 3, 1]).lookup(1, 4, 6) == [2, 3, 1, 2, 3, 1]


def test_extend_indexes_the_output_as_it_grows():
    idx = NgramIndex()
    idx.extend([1, 2, 3], [])
    idx.extend([1, 2, 3], [1, 2])
    assert idx.tokens == [1, 2, 3, 1, 2]
    assert idx.lookup(1, 3, 2) == [3, 1]


def test_skinny_head_matches_the_linear_module():
    """`ragged._head`: `W @ xᵀ` for a few packed tokens equals the LM head module's output to float
    rounding, and falls back to the module where it has a bias or a hook."""
    import torch

    from verst.rollout.engines.embedded.speculative.ragged import _head

    torch.manual_seed(0)
    head = torch.nn.Linear(32, 500, bias=False)
    for t in (1, 2, 5, 8, 9):
        x = torch.randn(t, 32)
        assert torch.allclose(_head(head, x), head(x), atol=1e-5)
    seen = []
    head.register_forward_hook(lambda m, a, o: seen.append(1))
    _head(head, torch.randn(3, 32))
    assert seen == [1]


def test_a_tie_prefers_a_continuation_clear_of_the_suffix_and_what_ties_agree_on():
    """tool_math's copy: after the answer's first `8` the observation's last `8` is the latest
    1-gram match, but what follows it is the suffix itself (`</tool_response> 8`); the first `8`'s
    continuation lies wholly before the suffix and wins the tie. Where several clear matches tie,
    only what their continuations agree on is proposed."""
    open_, close = 60, 61
    ctx = [2, 5, 2, open_, 8, 5, 4, 2, 8, close, 8]
    assert _index(ctx).lookup(1, 4, 4) == [5, 4, 2, 8]
    # a longer match still wins over a shorter, clear one
    assert _index([1, 8, 3, 9, 2, 8, 4, 2, 8]).lookup(1, 4, 2) == [4, 2]
    # no clear match of that length: the overlapping one (a loop) is still proposed
    assert _index([3, 4, 9, 9, 9]).lookup(1, 3, 4) == [9, 9, 9, 9]
    # `979493`: the first `9` ties with the observation's other clear `9`: they disagree at once
    assert _index([open_, 9, 7, 9, 4, 9, 3, close, 9]).lookup(1, 4, 4) == []
    assert _index([open_, 9, 7, 9, 4, 9, 3, close, 9, 7]).lookup(1, 4, 4) == [9, 4, 9, 3]
    # ... and agree on a prefix: that much is proposed
    assert _index([1, 2, 3, 5, 1, 2, 4, 9, 1]).lookup(1, 4, 3) == [2]
    # a clear match of max_n tokens is taken as it is, the latest
    assert _index([7, 1, 2, 5, 0, 1, 2, 6, 0, 1, 2]).lookup(1, 2, 2) == [6, 0]


def _reference(ctx: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule by brute force: the longest suffix match, clear of the suffix before not; a clear
    `max_n` match: the latest; else the common prefix of the tied matches' continuations."""
    from verst.rollout.engines.embedded.speculative.ngram import _continuation

    end = len(ctx)
    found = []  # (n, clear, j)
    for j in range(end - 1):
        n = 0
        while n < min(max_n, j + 1) and ctx[j - n] == ctx[end - 1 - n]:
            n += 1
        if n >= max(1, min_n):
            found.append((n, j + 1 + k <= end - n, j))
    if k <= 0 or not found:
        return []
    top = max(found)
    if top[:2] == (max_n, True):
        return _continuation(ctx, top[2], k)
    conts = [_continuation(ctx, j, k) for n, c, j in found if (n, c) == top[:2]]
    m = 0
    while m < k and all(c[m] == conts[0][m] for c in conts):
        m += 1
    return conts[0][:m]


@settings(max_examples=300, deadline=None)
@given(
    ctx=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 2),
    k=st.integers(0, 5),
)
def test_lookup_matches_the_rule_by_brute_force(ctx, min_n, extra, k):
    assert _index(ctx).lookup(min_n, min_n + extra, k) == _reference(ctx, min_n, min_n + extra, k)
