"""The embedded engine's sampler: the two-level inverse CDF draws from softmax(logits / T)
restricted to the top-k / top-p set, never a token of zero probability, for vocabularies that
are and are not a multiple of its block size."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from verst.rollout.engines.embedded.sampling import (
    BLOCK,
    BatchSampling,
    RowSampling,
    sample,
    seed_key,
    seeded_uniforms,
)


@pytest.mark.parametrize(
    ("vocab", "temperature", "top_k", "top_p", "seeded"),
    [
        (40, 1.0, -1, 1.0, False),
        (300, 0.7, -1, 1.0, False),
        (2 * BLOCK, 1.3, 50, 1.0, False),
        (777, 1.0, -1, 0.6, False),
        (40, 1.0, -1, 1.0, True),
        (777, 0.8, 20, 0.9, True),
    ],
)
def test_sampled_frequencies_match_the_truncated_softmax(vocab, temperature, top_k, top_p, seeded):
    """Seeded: every row its own seed, all at one position (the draws come from the seeds alone)."""
    n = 20_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * 2  # [vocab]
    rows = [RowSampling(temperature, top_p, top_k, 1000 + i if seeded else None) for i in range(n)]
    positions = torch.full((n,), 17)
    tokens, _ = sample(logits.expand(n, vocab), BatchSampling.build(rows, vocab, "cpu"), positions)
    probs = torch.softmax(logits.double() / temperature, -1)
    order = torch.argsort(probs, descending=True)
    keep = torch.zeros(vocab, dtype=torch.bool)
    cum = torch.cumsum(probs[order], 0)
    allowed = int((cum - probs[order] < top_p).sum())
    keep[order[: min(allowed, top_k if top_k > 0 else vocab)]] = True
    target = torch.where(keep, probs, 0.0)
    target /= target.sum()
    freq = torch.bincount(tokens, minlength=vocab).double() / n
    assert freq.shape == (vocab,) and freq[~keep].sum() == 0  # nothing outside the allowed set
    tol = 5 * (target * (1 - target) / n).sqrt() + 1e-4
    bad = ((freq - target).abs() > tol).nonzero()[:, 0].tolist()
    assert not bad, [(i, float(freq[i]), float(target[i])) for i in bad[:5]]


def test_one_hot_rows_and_mixed_greedy_and_seeded_rows():
    vocab = 300
    logits = torch.full((4, vocab), -30.0)
    logits[0, 299] = logits[1, 0] = logits[2, 256] = logits[3, 17] = 30.0  # block edges and padding
    rows = [RowSampling(1.0, 1.0, -1, 0), RowSampling(0.0, 1.0, -1, None)]
    rows += [RowSampling(1.0, 1.0, -1, 1), RowSampling(1.0, 1.0, -1, None)]
    tokens, lps = sample(logits, BatchSampling.build(rows, vocab, "cpu"), torch.tensor([5, 5, 7, 7]))
    assert tokens.tolist() == [299, 0, 256, 17]
    assert torch.allclose(lps.rows(), torch.log_softmax(logits, -1), atol=1e-6)


def test_one_block_vocabulary_draws_its_edges_and_never_a_dropped_token():
    """A vocabulary of one block (the plain-CDF path): first and last tokens are drawn, and a
    top-k row never draws past its k even when every dropped token sits before it."""
    vocab = 64
    logits = torch.full((4, vocab), -30.0)
    logits[0, 0] = logits[1, 63] = 30.0
    logits[2] = torch.arange(vocab, dtype=torch.float32) * 0.01  # top-2: only 62 and 63
    logits[3, 5] = logits[3, 6] = 0.0  # two equal tokens, the rest negligible
    rows = [RowSampling(1.0, 1.0, -1, None)] * 2 + [
        RowSampling(1.0, 1.0, 2, None),
        RowSampling(1.0, 1.0, -1, None),
    ]
    draws = [sample(logits, BatchSampling.build(rows, vocab, "cpu"))[0].tolist() for _ in range(200)]
    assert {d[0] for d in draws} == {0} and {d[1] for d in draws} == {63}
    assert {d[2] for d in draws} == {62, 63} and {d[3] for d in draws} == {5, 6}


def test_seeded_draws_are_uniform_and_independent_across_positions_and_seeds():
    """The (seed, position) hash behind seeded sampling: 4,000 consecutive seeds × 64 positions
    fill 64 bins evenly (chi-square), and neither the next position nor the next seed
    correlates with a draw."""
    seeds, positions = 4_000, 64
    keys = torch.tensor([seed_key(s) for s in range(seeds)])[:, None].expand(seeds, positions)
    pos = torch.arange(positions)[None, :].expand(seeds, positions)
    u = seeded_uniforms(keys.reshape(-1), pos.reshape(-1)).view(seeds, positions).double()
    assert float(u.min()) > 0.0 and float(u.max()) <= 1.0
    counts = torch.histc(u, bins=64, min=0.0, max=1.0)
    expected = u.numel() / 64
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 120, chi2  # 63 degrees of freedom: p ≈ 3e-5 at 120

    def corr(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a - a.mean(), b - b.mean()
        return float((a * b).sum() / (a.norm() * b.norm()))

    assert abs(corr(u[:, :-1].flatten(), u[:, 1:].flatten())) < 0.01  # next position
    assert abs(corr(u[:-1].flatten(), u[1:].flatten())) < 0.01  # next seed


@given(seed=st.integers(-(2**70), 2**70), position=st.integers(0, 2**31 - 1))
def test_a_seeded_draw_depends_on_the_seed_mod_2_64_and_the_position_only(seed, position):
    key = seed_key(seed)
    assert 0 <= key < 2**32 and key == seed_key(seed + 2**64)
    u = seeded_uniforms(torch.tensor([key, key]), torch.tensor([position, position]))
    assert u[0] == u[1] and 0.0 < float(u[0]) <= 1.0
    rows = [RowSampling(1.0, 1.0, -1, seed), RowSampling(1.0, 1.0, -1, None)]
    with pytest.raises(ValueError, match="seeded rows draw by position"):
        sample(torch.zeros(2, 8), BatchSampling.build(rows, 8, "cpu"))
