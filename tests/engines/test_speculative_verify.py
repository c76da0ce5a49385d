"""The speculative-sampling rule (`speculative.verify`): the emitted tokens are distributed exactly
as plain decoding's filtered target distribution (temperature, top-k, top-p), for point-mass
(n-gram) and draft-model proposals, seeded and not; greedy rows emit the argmax."""

from __future__ import annotations

import math

import pytest
import torch

from verst.rollout.engines.embedded.sampling import BatchSampling, RowSampling
from verst.rollout.engines.embedded.speculative.verify import filtered_probs, verify


def chi_square_z(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of `counts` against `probs` as a standard-normal z (Wilson–Hilferty);
    cells of tiny expectation are pooled. A token outside the support counts as a failure."""
    n = float(counts.sum())
    expected = probs.double() * n
    assert float(counts[probs == 0].sum()) == 0, "a token of zero target probability was emitted"
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


def target(scores: torch.Tensor, row: RowSampling) -> torch.Tensor:
    """Plain decoding's distribution for logits `scores` ([vocab]) under `row`'s settings."""
    s = BatchSampling.build([row], scores.shape[-1], "cpu")
    return filtered_probs(scores[None, None] * s.inv_temp[:, :, None], s)[0, 0]


SETTINGS = [(1.0, -1, 1.0), (0.7, 8, 1.0), (1.3, -1, 0.8), (0.6, 12, 0.9)]


CASES = [(*t, proposer, False) for t in SETTINGS for proposer in ("point", "draft")] + [
    (0.7, 8, 1.0, "point", True),
    (1.3, -1, 0.8, "draft", True),
]


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "proposer", "seeded"), CASES)
def test_emitted_tokens_follow_the_filtered_target(temperature, top_k, top_p, proposer, seeded):
    """Two proposals per row at fixed logits: the first emitted token ~ p_0, the second (given the
    first proposal was kept) ~ p_1. Proposals are chosen to be often right and often wrong."""
    vocab, n, k = 40, 16_000, 2
    gen = torch.Generator().manual_seed(vocab + int(100 * temperature) + top_k)
    logits = torch.randn(k + 1, vocab, generator=gen) * 2  # [k + 1, vocab]
    rows = [RowSampling(temperature, top_p, top_k, 77 + i if seeded else None) for i in range(n)]
    s = BatchSampling.build(rows, vocab, "cpu")
    p0, p1 = target(logits[0], rows[0]), target(logits[1], rows[0])
    if proposer == "point":  # the 2nd most likely token at position 0, the top one at position 1
        props = torch.tensor([int(p0.argsort()[-2]), int(p1.argmax())]).expand(n, k).clone()
        q = None
    else:  # a draft distribution unlike p, proposals drawn from it
        qd = torch.softmax(torch.randn(k, vocab, generator=gen), -1)
        props = torch.stack([torch.multinomial(qd[t], n, replacement=True, generator=gen) for t in range(k)], 1)
        q = qd.expand(n, k, vocab)
    out = verify(logits.expand(n, k + 1, vocab), props, torch.full((n,), k), q, s, torch.full((n,), 9))
    first = out.tokens[:, 0]
    assert chi_square_z(torch.bincount(first, minlength=vocab), p0) < 4.5
    kept = out.accepted >= 1
    assert int(kept.sum()) > 400
    second = out.tokens[kept, 1]
    assert chi_square_z(torch.bincount(second, minlength=vocab), p1) < 4.5


def test_greedy_rows_emit_the_argmax_and_keep_only_argmax_proposals():
    vocab = 30
    logits = torch.randn(4, 3, vocab)
    best = logits.argmax(-1)  # [4, 3]
    props = best[:, :2].clone()
    props[1, 0] = (best[1, 0] + 1) % vocab  # row 1: first proposal wrong
    props[2, 1] = (best[2, 1] + 1) % vocab  # row 2: second proposal wrong
    s = BatchSampling.build([RowSampling(0.0, 1.0, -1)] * 4, vocab, "cpu")
    counts = torch.tensor([2, 2, 2, 1])
    out = verify(logits, props, counts, None, s, torch.zeros(4, dtype=torch.long))
    assert out.accepted.tolist() == [2, 0, 1, 1]
    for i, a in enumerate(out.accepted.tolist()):
        assert out.tokens[i, : a + 1].tolist() == best[i, : a + 1].tolist()


def test_seeded_rows_are_reproducible_and_independent_of_their_neighbours():
    vocab, k = 50, 3
    logits = torch.randn(6, k + 1, vocab)
    props = torch.randint(0, vocab, (6, k))
    rows = [RowSampling(1.0, 0.9, -1, 5 + i) for i in range(6)]

    def run(order: list[int]) -> list[list[int]]:
        sub = [rows[i] for i in order]
        s = BatchSampling.build(sub, vocab, "cpu")
        idx = torch.tensor(order)
        v = verify(logits[idx], props[idx], torch.full((len(order),), k), None, s, torch.full((len(order),), 4))
        return [v.tokens[j, : int(v.accepted[j]) + 1].tolist() for j in range(len(order))]

    full = run(list(range(6)))
    assert run([5, 2, 0]) == [full[5], full[2], full[0]]
    assert run(list(range(6))) == full
