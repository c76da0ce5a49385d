"""`hidden_logprobs(backend='auto')`: small problems skip the chunked kernel, same values and grads.

A tiny vocabulary's full logits are smaller than one chunk of a real one, so 'auto' computes
them with one matmul when `N * V <= DIRECT_MAX_LOGITS`; larger problems stay chunked. Both
must agree with the chunked torch kernel (log-probs, entropy and gradients), and `unflatten`
must lay responses out exactly as before (right-padded, gradients to every token).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.trainer.train import logprobs
from verst.trainer.train.logprobs import hidden_logprobs, pack_sequences, unflatten


def grads(backend: str, n: int, v: int, temperature: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, 16, generator=g, requires_grad=True)  # [N, H]
    weight = torch.randn(v, 16, generator=g, requires_grad=True)  # [V, H]
    target = torch.randint(0, v, (n,), generator=g)
    adv = torch.randn(n, generator=g)
    lp, ent = hidden_logprobs(
        hidden, weight, target, temperature=temperature, return_entropy=True, backend=backend
    )
    ((lp * adv).sum() + 0.1 * ent.sum()).backward()
    return lp.detach(), ent.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize(("n", "v", "temperature"), [(40, 64, 1.0), (300, 64, 0.7), (5, 33, 1.3)])
def test_direct_path_matches_the_chunked_kernel(n, v, temperature):
    direct = grads("auto", n, v, temperature)
    chunked = grads("torch", n, v, temperature)
    for a, b in zip(direct, chunked, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_auto_dispatches_on_size(monkeypatch):
    calls = []
    import verst.kernels

    real = verst.kernels.linear_token_logprobs

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(verst.kernels, "linear_token_logprobs", spy)
    grads("auto", 40, 64, 1.0)
    assert calls == []  # 40 x 64 logits: direct
    monkeypatch.setattr(logprobs, "DIRECT_MAX_LOGITS", 40 * 64 - 1)
    small = grads("auto", 40, 64, 1.0)
    assert len(calls) == 1  # one element over the limit: chunked
    for a, b in zip(small, grads("torch", 40, 64, 1.0), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=8), st.integers(0, 3))
def test_unflatten_right_pads_each_response(lengths, slack):
    width = max(lengths) + slack
    flat = torch.arange(1.0, sum(lengths) + 1, requires_grad=True)  # [sum(R)]
    out = unflatten(flat, lengths, width)  # [num_seqs, width]
    expected = torch.zeros(len(lengths), width)
    offset = 0
    for row, r in enumerate(lengths):
        expected[row, :r] = torch.arange(offset + 1.0, offset + r + 1)
        offset += r
    assert torch.equal(out.detach(), expected)
    out.sum().backward()
    assert torch.equal(flat.grad, torch.ones_like(flat))


def test_unflatten_refuses_a_response_wider_than_the_batch():
    with pytest.raises(ValueError, match="does not fit"):
        unflatten(torch.zeros(5), [5], 4)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(2, 9), st.integers(0, 1)), min_size=1, max_size=6), st.integers(0, 3))
def test_padded_layout_puts_each_sequence_left_aligned(specs, pad_id):
    tokens = [[10 + (7 * i + j) % 40 for j in range(n)] for i, (n, _) in enumerate(specs)]
    resp = [min(n - 1, 1 + extra) for n, extra in specs]
    out = pack_sequences(tokens, resp, packing=False, pad_id=pad_id)
    width = max(map(len, tokens))
    gather, targets = [], []
    for row, (seq, r) in enumerate(zip(tokens, resp, strict=True)):
        n = len(seq)
        assert out.input_ids[row].tolist() == seq + [pad_id] * (width - n)
        assert out.attention_mask[row].tolist() == [1] * n + [0] * (width - n)
        assert out.position_ids[row].tolist() == list(range(n)) + [n - 1] * (width - n)
        gather += range(row * width + n - r - 1, row * width + n - 1)
        targets += seq[n - r :]
    assert out.gather_index.tolist() == gather and out.target_ids.tolist() == targets


def test_keeping_the_logits_gives_the_recompute_values_and_gradients():
    """`keep_logits_mib` (train.logprob_keep_logits_mib) only changes where the backward gets
    the logits: kept from the forward or recomputed, the results are bit-identical."""
    results = []
    for keep_mib in (0, None):  # 0 = recompute; None = the kernels' default budget (kept here)
        g = torch.Generator().manual_seed(3)
        hidden = torch.randn(70, 16, generator=g, requires_grad=True)  # [N, H]
        weight = torch.randn(20_000, 16, generator=g, requires_grad=True)  # [V, H]: chunked
        target = torch.randint(0, 20_000, (70,), generator=g)
        lp, ent = hidden_logprobs(
            hidden, weight, target, temperature=0.8, return_entropy=True, keep_logits_mib=keep_mib
        )
        ((lp * torch.linspace(-1, 1, 70)).sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), hidden.grad, weight.grad))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_the_config_default_is_the_kernels_default():
    from verst.kernels import KEEP_LOGITS_MAX_BYTES
    from verst.trainer.config import TrainConfig

    assert TrainConfig.model_fields["logprob_keep_logits_mib"].default * 2**20 == KEEP_LOGITS_MAX_BYTES
