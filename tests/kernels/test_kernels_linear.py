"""Chunked linear_token_logprobs / linear_topk_logprobs vs float64 naive full-logits reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernels_checks import EPS32, OUT_DTYPE_EPS, assert_close_report, assert_grad_close, logprob_tol
from torch.utils._python_dispatch import TorchDispatchMode

from verst.kernels import linear_token_logprobs, linear_topk_logprobs
from verst.kernels.reference import reference_linear_token_logprobs, reference_topk_logprobs

BACKENDS = ["torch", "triton"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(lead, H, V, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn((*lead, H), generator=g, dtype=torch.float64) * scale).to(dtype)
    weight = (torch.randn((V, H), generator=g, dtype=torch.float64) / H**0.5).to(dtype)
    targets = torch.randint(0, V, lead, generator=g)
    return hidden, weight, targets


def _tol(hidden, weight, T):
    """float32 tolerance plus the rounding of the matmul output to a low-precision dtype."""
    logits = hidden.double() @ weight.double().T
    return logprob_tol(logits, T) + 4 * OUT_DTYPE_EPS[hidden.dtype] * float(logits.abs().max()) / T


def _check(hidden, weight, targets, T, chunk, backend, seed=0):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp, ent = linear_token_logprobs(h, w, targets, T, True, chunk_size=chunk, backend=backend)
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref_lp, ref_ent = reference_linear_token_logprobs(hr, wr, targets, T, True)
    tol = _tol(hidden, weight, T)
    assert_close_report(lp, ref_lp, atol=tol, name="logprobs")
    assert_close_report(ent, ref_ent, atol=tol, name="entropy")
    g = torch.Generator().manual_seed(seed + 7)
    g_lp = torch.randn(lp.shape, generator=g, dtype=torch.float64)  # per-token, signed (advantages)
    g_ent = torch.randn(lp.shape, generator=g, dtype=torch.float64)
    ((lp.double() * g_lp).sum() + (ent.double() * g_ent).sum()).backward()
    ((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum()).backward()
    extra = 8 * OUT_DTYPE_EPS[hidden.dtype]
    assert h.grad.dtype == hidden.dtype and w.grad.dtype == weight.dtype
    # The gradient's error floor follows the logits' own rounding (the chunk matmul runs in the
    # inputs' dtype): a logit off by d moves each probability by up to ~p * d, so the gradient wrt
    # hidden (weight) can be off by ~2 * min(1, d) * |g| * max|weight| (max|hidden|), plus the
    # (1 - p) a probability loses when it rounds to 1 in float32 — large only for badly
    # conditioned rows (|logits| ~ 1e3), where the reference gradient itself can be ~1e-9.
    logits_max = float((hidden.double() @ weight.double().T).abs().max()) if lp.numel() else 0.0
    d = (16 * EPS32 + 4 * OUT_DTYPE_EPS[hidden.dtype]) * logits_max / T
    g_max = float(g_lp.abs().max() + g_ent.abs().max()) if lp.numel() else 0.0
    sat = (2 * min(1.0, d) + 8 * EPS32) * g_max / T
    assert_grad_close(
        h.grad, hr.grad, name="grad_hidden", extra_rel=extra, floor=sat * float(weight.double().abs().max())
    )
    assert_grad_close(
        w.grad, wr.grad, name="grad_weight", extra_rel=extra, floor=sat * float(hidden.double().abs().max())
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("lead", "H", "V", "chunk"),
    [((1,), 16, 7, 256), ((9,), 16, 1000, 4), ((2, 3), 8, 300, 5), ((5,), 32, 4500, 2)],
    ids=str,
)
def test_linear_grid(backend, dtype, lead, H, V, chunk):
    hidden, weight, targets = _inputs(lead, H, V, dtype, seed=V)
    _check(hidden, weight, targets, 0.8, chunk, backend)


@pytest.mark.parametrize("keep_budget", [0, None], ids=["recompute", "keep"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_arbitrary_upstream_gradients_after_forward(backend, keep_budget):
    """The upstream gradient is not known at forward time (GRPO: advantages, masks, clipping).
    Two different upstream gradients through the same graph give the two correct gradients,
    whether the backward recomputes the logits or reads the forward's (which it must not clobber)."""
    hidden, weight, targets = _inputs((6,), 8, 50, torch.float32, seed=2)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp = linear_token_logprobs(
        h, w, targets, 0.8, chunk_size=2, backend=backend, keep_logits_max_bytes=keep_budget
    )
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = reference_linear_token_logprobs(hr, wr, targets, 0.8)
    for upstream in (
        torch.tensor([1.0, -1.0, 0.0, 2.0, 0.0, -0.5]),
        torch.tensor([0.0, 0.0, 3.0, 0.0, 1.0, 0.0]),
    ):
        ratio = torch.exp(lp - lp.detach())  # PPO-style ratio, clipped per token
        loss = -(torch.clamp(ratio, 0.8, 1.2) * upstream).sum()
        gh, gw = torch.autograd.grad(loss, (h, w), retain_graph=True)
        ref_loss = -(torch.clamp(torch.exp(ref - ref.detach()), 0.8, 1.2) * upstream.double()).sum()
        rh, rw = torch.autograd.grad(ref_loss, (hr, wr), retain_graph=True)
        assert_grad_close(gh, rh, name="grad_hidden")
        assert_grad_close(gw, rw, name="grad_weight")


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_weight_or_hidden(backend):
    hidden, weight, targets = _inputs((4,), 8, 40, torch.float32, seed=3)
    h = hidden.clone().requires_grad_()
    linear_token_logprobs(h, weight, targets, chunk_size=3, backend=backend).sum().backward()
    assert h.grad is not None and weight.grad is None
    w = weight.clone().requires_grad_()
    linear_token_logprobs(hidden, w, targets, chunk_size=3, backend=backend).sum().backward()
    hr, wr = hidden.double(), weight.double().requires_grad_()
    reference_linear_token_logprobs(hr, wr, targets).sum().backward()
    assert_grad_close(w.grad, wr.grad, name="grad_weight")


class _LargestOutput(TorchDispatchMode):
    """Records the largest tensor any aten op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:  # (interpreter: byte copies)
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_logits_never_materialised(backend):
    """Outside the keep budget (here 0: always recompute) no op makes anything `[N, V]`."""
    N, H, V, chunk = 64, 8, 500, 8
    hidden, weight, targets = _inputs((N,), H, V, torch.float32, seed=4)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with _LargestOutput() as mode:
        lp, ent = linear_token_logprobs(
            h, w, targets, 1.0, True, chunk_size=chunk, backend=backend, keep_logits_max_bytes=0
        )
        (lp * torch.randn(N)).sum().add(ent.sum()).backward()
    assert mode.largest <= max(chunk * V, V * H), (
        f"a tensor of {mode.largest} elements (full logits: {N * V})"
    )
    with _LargestOutput() as mode:
        out = linear_topk_logprobs(
            h, w, 5, token_ids=torch.randint(0, V, (N, 3)), chunk_size=chunk, backend=backend,
            keep_logits_max_bytes=N * V * 4 - 1,
        )  # fmt: skip
        out.token_logprobs.sum().backward()
    assert mode.largest <= max(chunk * V, V * H), (
        f"a tensor of {mode.largest} elements (full logits: {N * V})"
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_topk(backend, dtype):
    hidden, weight, _ = _inputs((2, 5), 16, 700, dtype, seed=5)
    ids = torch.randint(0, 700, (2, 5, 4))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_topk_logprobs(h, w, 6, 0.9, token_ids=ids, chunk_size=3, backend=backend)
    logits64 = hidden.double() @ weight.double().T
    ref_vals, _ = reference_topk_logprobs(logits64, 6, 0.9)
    tol = _tol(hidden, weight, 0.9)
    assert_close_report(out.values, ref_vals, atol=tol, name="top-k values")
    full = torch.log_softmax(logits64 / 0.9, -1)
    assert_close_report(out.values, full.gather(-1, out.indices), atol=tol, name="value@index")
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = torch.log_softmax(hr @ wr.T / 0.9, -1).gather(-1, ids)
    assert_close_report(out.token_logprobs, ref, atol=tol, name="token_logprobs")
    g = torch.randn(2, 5, 4, dtype=torch.float64)
    (out.token_logprobs.double() * g).sum().backward()
    (ref * g).sum().backward()
    extra = 8 * OUT_DTYPE_EPS[dtype]
    assert_grad_close(h.grad, hr.grad, name="grad_hidden", extra_rel=extra)
    assert_grad_close(w.grad, wr.grad, name="grad_weight", extra_rel=extra)
    plain = linear_topk_logprobs(hidden, weight, 6, 0.9, chunk_size=4, backend=backend)
    assert plain.token_logprobs is None
    assert_close_report(plain.values, out.values, atol=tol, name="values without token_ids")


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    N=st.integers(1, 7),
    H=st.integers(1, 12),
    V=st.integers(1, 150),
    chunk=st.integers(1, 8),
    scale=st.sampled_from([1e-2, 1.0, 1e3]),
    temperature=st.floats(0.25, 4.0),
    dtype=st.sampled_from(DTYPES),
    backend=st.sampled_from(BACKENDS),
    seed=st.integers(0, 2**16),
)
def test_linear_property(N, H, V, chunk, scale, temperature, dtype, backend, seed):
    hidden, weight, targets = _inputs((N,), H, V, dtype, seed=seed, scale=scale)
    _check(hidden, weight, targets, temperature, chunk, backend, seed=seed)


@pytest.mark.slow
@pytest.mark.interpret_large
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_large(backend, dtype):
    hidden, weight, targets = _inputs((300,), 64, 32_000, dtype, seed=6)
    _check(hidden, weight, targets, 0.7, 128, backend)


def test_ambient_autocast_does_not_change_the_chunk_precision():
    """Under autocast the chunk matmuls still run in the inputs' dtype, forward and recompute alike."""
    hidden, weight, targets = _inputs((6,), 8, 90, torch.float32, seed=8)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp = linear_token_logprobs(h, w, targets, 0.9, chunk_size=4)
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = reference_linear_token_logprobs(hr, wr, targets, 0.9)
    assert_close_report(lp, ref, atol=_tol(hidden, weight, 0.9), name="logprobs under autocast")
    g = torch.randn(6, dtype=torch.float64)
    (lp.double() * g).sum().backward()
    (ref * g).sum().backward()
    assert_grad_close(h.grad, hr.grad, name="grad_hidden")
    assert_grad_close(w.grad, wr.grad, name="grad_weight")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("with_bias", "softcap"), [(True, None), (False, 1.5), (True, 3.0)], ids=str)
def test_linear_bias_and_softcap_match_float64(backend, dtype, with_bias, softcap):
    """The LM-head bias and the logit soft-cap (Gemma-2/3 `final_logit_softcapping`) applied per
    chunk: log-probs, entropy, top-k and the gradients of hidden, weight and bias match float64."""
    hidden, weight, targets = _inputs((7,), 8, 120, dtype, seed=9, scale=3.0)  # logits past the cap
    bias = (torch.randn(120, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2).to(dtype)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = bias.clone().requires_grad_() if with_bias else None
    lp, ent = linear_token_logprobs(
        h, w, targets, 0.8, True, chunk_size=3, backend=backend, lm_head_bias=b, softcap=softcap
    )
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    br = bias.double().requires_grad_() if with_bias else None
    ref_lp, ref_ent = reference_linear_token_logprobs(
        hr, wr, targets, 0.8, True, lm_head_bias=br, softcap=softcap
    )
    tol = _tol(hidden, weight, 0.8) + (4 * OUT_DTYPE_EPS[dtype] * float(bias.abs().max()) if with_bias else 0)
    assert_close_report(lp, ref_lp, atol=tol, name="logprobs")
    assert_close_report(ent, ref_ent, atol=tol, name="entropy")
    g = torch.randn(7, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ((lp.double() * g).sum() + ent.double().sum()).backward()
    ((ref_lp * g).sum() + ref_ent.sum()).backward()
    extra = 8 * OUT_DTYPE_EPS[dtype]
    assert_grad_close(h.grad, hr.grad, name="grad_hidden", extra_rel=extra)
    assert_grad_close(w.grad, wr.grad, name="grad_weight", extra_rel=extra)
    if with_bias:
        assert b.grad.dtype == dtype
        assert_grad_close(b.grad, br.grad, name="grad_bias", extra_rel=extra)
    top = linear_topk_logprobs(
        hidden, weight, 4, 0.8, chunk_size=3, backend=backend, lm_head_bias=bias if with_bias else None,
        softcap=softcap,
    )  # fmt: skip
    full = reference_linear_token_logprobs(
        hidden, weight, torch.arange(120).expand(7, 120), 0.8, lm_head_bias=bias if with_bias else None,
        softcap=softcap,
    )  # fmt: skip  # [7, 120]
    assert_close_report(top.values, full.topk(4, -1).values, atol=tol, name="top-k values")


def test_linear_head_post_arguments_are_checked():
    hidden, weight, targets = _inputs((3,), 4, 10, torch.float32, seed=1)
    with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
        linear_token_logprobs(hidden, weight, targets, softcap=0.0)
    with pytest.raises(ValueError, match=r"lm_head_bias must be \[V=10\]"):
        linear_token_logprobs(hidden, weight, targets, lm_head_bias=torch.zeros(9))
