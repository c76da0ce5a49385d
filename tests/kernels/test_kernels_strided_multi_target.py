"""Triton row kernels (interpreted on CPU) vs float64: a `[B, T+1, V][:, :-1]` slice is read in
place through its strides (no full copy), and the backward with 16 target ids per row (the OPD
token-id path, BLOCK_M = 16) — duplicates and ids spread over several vocabulary blocks."""

from __future__ import annotations

import pytest
import torch
from kernels_checks import assert_close_report, assert_grad_close, logprob_tol, make_logits

from verst.kernels import token_logprobs, topk_logprobs
from verst.kernels._api import _rows
from verst.kernels._launchers import TritonRowOps
from verst.kernels.reference import reference_token_logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shifted_slice_is_read_in_place(dtype):
    full = make_logits((2, 6, 300), dtype, seed=3)  # [B, T+1, V]
    logits = full[:, :-1]  # [B, T, V]: no [N, V] view exists
    with pytest.raises(RuntimeError):
        logits.view(-1, 300)
    assert _rows(logits, strided=True).data_ptr() == full.data_ptr()  # a view, not a copy
    assert _rows(logits, strided=True).shape == (2, 5, 300)
    targets = torch.randint(0, 300, (2, 5))
    x = full.clone().requires_grad_()
    lp, ent = token_logprobs(x[:, :-1], targets, 0.7, return_entropy=True, backend="triton")
    xr = full.double().requires_grad_()
    ref_lp, ref_ent = reference_token_logprobs(xr[:, :-1], targets, 0.7, return_entropy=True)
    tol = logprob_tol(logits, 0.7)
    assert_close_report(lp, ref_lp, atol=tol, name="logprobs")
    assert_close_report(ent, ref_ent, atol=tol, name="entropy")
    g = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.randn(2, 5, generator=g, dtype=torch.float64), torch.randn(2, 5, generator=g).double()
    ((lp.double() * g_lp).sum() + (ent.double() * g_ent).sum()).backward()
    ((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum()).backward()
    assert_grad_close(x.grad, xr.grad, name="grad (last position untouched)")
    assert (x.grad[:, -1] == 0).all()
    top = topk_logprobs(full[:, :-1], 3, 0.7, backend="triton")
    ref_top = torch.log_softmax(full[:, :-1].double() / 0.7, -1).topk(3, -1).values
    assert_close_report(top.values, ref_top, atol=tol, name="top-k values")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_with_sixteen_targets_per_row(dtype):
    V, M = 1000, 16
    logits = make_logits((3, V), dtype, scale=6.0, seed=7)
    gen = torch.Generator().manual_seed(2)
    targets = torch.randint(0, V, (3, M), generator=gen)
    targets[0, 1] = targets[0, 0]  # a duplicate id adds twice
    targets[1, :4] = torch.tensor([0, 127, 128, V - 1])  # block edges at block_v = 128
    lse = torch.logsumexp(logits.float() / 0.9, -1)
    lp, _, lse_k = TritonRowOps.forward(logits, targets, 0.9, False, block_v=128)
    g_lp = torch.randn(3, M, generator=gen)
    grad = TritonRowOps.backward(logits, targets, 0.9, lse_k, None, g_lp, None, torch.float32, block_v=128)
    xr = logits.double().requires_grad_()
    ref = torch.log_softmax(xr / 0.9, -1).gather(-1, targets)
    (ref * g_lp.double()).sum().backward()
    assert_close_report(lp, ref, atol=logprob_tol(logits, 0.9), name="logprobs")
    assert_close_report(lse_k, lse, atol=1e-4, name="lse")
    assert_grad_close(grad, xr.grad, name="grad with 16 targets per row")
