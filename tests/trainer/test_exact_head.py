"""The exactly on-policy LM head (`verst.trainer.train.exact_head`), under hypothesis.

Its forward's log-probs must be the engine's bits: `exact_logprobs(exact_linear(h, W, b) * (1/T))` at the
target (its entropy only close to the same ops'), for any row count (its row chunks included) and whether or not the forward keeps its
log-probs for the backward. Its analytic backward must be the gradient autograd takes through
those ops, for the log-prob term, the entropy term, both, and a second backward of a retained
graph (the kept log-probs are overwritten by the first).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.rollout.exact_ops import exact_linear, exact_logprobs
from verst.trainer.train.exact_head import CHUNK_ROWS, exact_head_logprobs


def _reference(h, w, b, target, temperature):
    logp = exact_logprobs(exact_linear(h, w, b), 1.0 / temperature)
    return logp.gather(-1, target[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def _close(got, want):
    scale = max(float(want.abs().max()), 1e-6)
    return float((got - want).abs().max()) / scale < 1e-4


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 2 * CHUNK_ROWS + 40),
    v=st.sampled_from([16, 300, 1000]),
    temperature=st.sampled_from([1.0, 0.7, 1.3]),
    bias=st.booleans(),
    keep=st.sampled_from([None, 0]),
    weights=st.sampled_from([(1.0, 0.0), (0.0, 1.0), (1.0, 0.3)]),
    seed=st.integers(0, 2**16),
)
def test_forward_is_the_engine_bits_and_backward_is_autograds(n, v, temperature, bias, keep, weights, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, 24, generator=g, requires_grad=True)
    w = (torch.randn(v, 24, generator=g) * 0.3).requires_grad_(True)
    b = torch.randn(v, generator=g).requires_grad_(True) if bias else None
    target = torch.randint(0, v, (n,), generator=g)
    lp, ent = exact_head_logprobs(h, w, b, target, temperature, keep_bytes=keep)
    want_lp, want_ent = _reference(h, w, b, target, temperature)
    assert torch.equal(lp, want_lp)  # the engine's bits
    assert _close(ent, want_ent)  # the entropy: a metric and a loss term, no particular bits
    at = seed % n  # a row alone: the same bits as in the chunked call
    assert torch.equal(
        exact_head_logprobs(h[at : at + 1], w, b, target[at : at + 1], temperature)[0][0], lp[at]
    )
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    a, c = weights
    params = [h, w] + ([b] if b is not None else [])
    loss = (lp * g_lp).sum() * a + ((ent * g_ent).sum() * c if c else 0.0)
    want = (want_lp * g_lp).sum() * a + ((want_ent * g_ent).sum() * c if c else 0.0)
    for got_grad, want_grad in zip(
        torch.autograd.grad(loss, params), torch.autograd.grad(want, params), strict=True
    ):
        assert _close(got_grad, want_grad)


@pytest.mark.parametrize("keep", [None, 0])
def test_a_retained_graph_backs_up_twice_to_the_same_gradient(keep):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(40, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    target = torch.randint(0, 50, (40,), generator=g)
    lp, ent = exact_head_logprobs(h, w, None, target, 1.0, keep_bytes=keep)
    loss = lp.sum() + 0.1 * ent.sum()
    first = torch.autograd.grad(loss, [h, w], retain_graph=True)
    second = torch.autograd.grad(loss, [h, w])
    for x, y in zip(first, second, strict=True):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6)
