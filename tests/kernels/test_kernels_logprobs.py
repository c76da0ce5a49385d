"""token_logprobs (+ entropy): Triton (interpreted on CPU) and torch vs a float64 reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernels_checks import EPS32, assert_close_report, assert_grad_close, logprob_tol, make_logits

from verst.kernels import token_logprobs
from verst.kernels._launchers import TritonRowOps
from verst.kernels._torch_impl import TorchRowOps
from verst.kernels.reference import reference_token_logprobs

BACKENDS = ["torch", "triton"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (leading shape, V): single row, V below / not a multiple of the 4096 default block, several
# blocks, a long row (9 blocks), leading batch dims.
SHAPES = [((1,), 7), ((3,), 1000), ((4,), 5000), ((1,), 33_000), ((2, 3), 257)]


def _check(logits, targets, T, backend, upstream_seed=1):
    """Forward (log-probs, entropy) and gradients under non-uniform upstream gradients."""
    x = logits.clone().requires_grad_()
    lp, ent = token_logprobs(x, targets, T, return_entropy=True, backend=backend)
    ref_x = logits.double().requires_grad_()
    ref_lp, ref_ent = reference_token_logprobs(ref_x, targets, T, return_entropy=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    tol = logprob_tol(logits, T)
    assert_close_report(lp, ref_lp, atol=tol, name=f"logprobs[{backend}]")
    assert_close_report(ent, ref_ent, atol=tol, name=f"entropy[{backend}]")
    g = torch.Generator().manual_seed(upstream_seed)
    g_lp = torch.randn(lp.shape, generator=g, dtype=torch.float64)
    g_ent = torch.randn(lp.shape, generator=g, dtype=torch.float64)
    ((lp.double() * g_lp).sum() + (ent.double() * g_ent).sum()).backward()
    ((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum()).backward()
    assert x.grad.dtype == logits.dtype
    # A float32 log-prob is off by ~eps32 * max|logits / T| (absolute), and the entropy gradient
    # -p (log p + H) carries that error even where every reference gradient is tiny (a saturated
    # row: V=2, gap 30, gradients ~1e-14): the absolute floor says so.
    scale = max(1.0, float(logits.double().abs().max()) / T) if logits.numel() else 1.0
    g_max = float(g_lp.abs().max() + g_ent.abs().max()) if lp.numel() else 0.0
    floor = 4 * EPS32 * scale * g_max / T
    assert_grad_close(x.grad, ref_x.grad, name=f"grad_logits[{backend}]", floor=floor)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("lead", "V"), SHAPES, ids=lambda v: str(v))
def test_token_logprobs_grid(backend, dtype, lead, V):
    logits = make_logits((*lead, V), dtype, seed=V)
    targets = torch.randint(0, V, lead)
    _check(logits, targets, 0.7 if V % 2 else 1.0, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_log_probs_only_gradient_and_entropy_only_gradient(backend):
    logits = make_logits((3, 300), torch.float32, seed=3)
    targets = torch.tensor([0, 299, 5])
    x = logits.clone().requires_grad_()
    token_logprobs(x, targets, 1.3, backend=backend).mul(torch.tensor([1.0, -2.0, 0.5])).sum().backward()
    xr = logits.double().requires_grad_()
    reference_token_logprobs(xr, targets, 1.3).mul(
        torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    ).sum().backward()
    assert_grad_close(x.grad, xr.grad, name="grad(lp only)")
    x.grad = None
    xr.grad = None
    token_logprobs(x, targets, 1.3, True, backend=backend)[1].sum().backward()
    reference_token_logprobs(xr, targets, 1.3, True)[1].sum().backward()
    assert_grad_close(x.grad, xr.grad, name="grad(entropy only)")


@pytest.mark.parametrize("block_v", [32, 128])
def test_triton_streaming_over_many_blocks_matches_torch_ops(block_v):
    """Launcher level, small blocks: many online log-sum-exp steps, several targets per row."""
    logits = make_logits((3, 1001), torch.float32, scale=8.0, seed=block_v)
    targets = torch.randint(0, 1001, (3, 5))
    targets[0, :2] = torch.tensor([0, 1000])  # first and last column
    lp, ent, lse = TritonRowOps.forward(logits, targets, 0.9, True, block_v=block_v)
    ref_lp, ref_ent = reference_token_logprobs(logits, targets, 0.9, True)
    tol = logprob_tol(logits, 0.9)
    assert_close_report(lp, ref_lp, atol=tol, name="lp")
    assert_close_report(ent, ref_ent, atol=tol, name="entropy")
    assert_close_report(lse, torch.logsumexp(logits.double() / 0.9, -1), atol=tol, name="lse")
    g_lp = torch.randn(3, 5)
    g_ent = torch.randn(3)
    got = TritonRowOps.backward(logits, targets, 0.9, lse, ent, g_lp, g_ent, torch.float32, block_v=block_v)
    want = TorchRowOps.backward(logits, targets, 0.9, lse, ent, g_lp, g_ent, torch.float32)
    xr = logits.double().requires_grad_()
    a, b = reference_token_logprobs(xr, targets, 0.9, True)
    ((a * g_lp.double()).sum() + (b * g_ent.double()).sum()).backward()
    assert_grad_close(got, xr.grad, name="triton grad")
    assert_grad_close(want, xr.grad, name="torch grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_inf_logits_masked_vocabulary(backend):
    """-inf entries (masked vocabulary) give finite log-probs elsewhere and zero gradient there."""
    logits = make_logits((2, 200), torch.float32, seed=5)
    logits[:, 150:] = float("-inf")
    logits[1, :70] = float("-inf")
    targets = torch.tensor([3, 100])
    x = logits.clone().requires_grad_()
    lp, ent = token_logprobs(x, targets, 1.0, True, backend=backend)
    ref_lp, ref_ent = reference_token_logprobs(logits, targets, 1.0, True)
    assert_close_report(lp, ref_lp, atol=1e-5, name="lp")
    assert_close_report(ent, ref_ent, atol=1e-5, name="entropy")
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[:, 150:] == 0).all()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 3),
    V=st.integers(1, 300),
    scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4]),
    temperature=st.floats(0.25, 4.0),
    dtype=st.sampled_from(DTYPES),
    backend=st.sampled_from(BACKENDS),
    seed=st.integers(0, 2**16),
)
def test_token_logprobs_property(rows, V, scale, temperature, dtype, backend, seed):
    """Any shape, magnitude (incl. +-1e4 logits) and temperature: matches float64."""
    logits = make_logits((rows, V), dtype, scale=scale, seed=seed)
    targets = torch.randint(0, V, (rows,), generator=torch.Generator().manual_seed(seed))
    _check(logits, targets, temperature, backend, upstream_seed=seed)


@pytest.mark.slow
@pytest.mark.interpret_large
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("lead", "V"), [((16,), 32_000), ((3,), 151_936), ((4, 8), 4097)], ids=str)
def test_token_logprobs_large_grid(backend, dtype, lead, V):
    logits = make_logits((*lead, V), dtype, scale=5.0, seed=V)
    _check(logits, torch.randint(0, V, lead), 0.6, backend)
