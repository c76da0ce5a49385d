"""Prompt lookup (`speculative/ngram.py`): what a lookup proposes; and the ragged verify's LM
head (`speculative/ragged._head`)."""

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
