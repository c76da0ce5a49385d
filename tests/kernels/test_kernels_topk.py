"""topk_logprobs (+ token-id log-probs): Triton (interpreted) and torch vs a float64 reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernels_checks import assert_close_report, assert_grad_close, logprob_tol, make_logits

from verst.kernels import TopKLogprobs, topk_logprobs
from verst.kernels._launchers import TritonRowOps
from verst.kernels.reference import reference_full_logprobs, reference_token_logprobs, reference_topk_logprobs

BACKENDS = ["torch", "triton"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _check_topk(logits: torch.Tensor, k: int, T: float, result: TopKLogprobs, name: str) -> None:
    """Values equal the reference top-k values; indices are distinct, in range, and point at
    entries whose reference log-prob equals the returned value (ties may pick either index)."""
    ref_vals, _ = reference_topk_logprobs(logits, k, T)
    full = reference_full_logprobs(logits, T)
    tol = logprob_tol(logits, T)
    assert result.values.dtype == torch.float32 and result.indices.dtype == torch.int64
    assert_close_report(result.values, ref_vals, atol=tol, name=f"{name} values")
    V = logits.shape[-1]
    assert ((result.indices >= 0) & (result.indices < V)).all(), f"{name}: index out of range"
    srt = result.indices.sort(-1).values
    assert (srt[..., 1:] != srt[..., :-1]).all(), f"{name}: duplicate indices"
    assert_close_report(result.values, full.gather(-1, result.indices), atol=tol, name=f"{name} value@index")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("lead", "V", "k"), [((1,), 5, 5), ((3,), 1000, 8), ((2,), 5000, 20), ((2, 2), 97, 1)], ids=str
)
def test_topk_grid(backend, dtype, lead, V, k):
    logits = make_logits((*lead, V), dtype, seed=V + k)
    _check_topk(logits, k, 0.8, topk_logprobs(logits, k, 0.8, backend=backend), backend)


@pytest.mark.parametrize("block_v", [16, 64])
def test_triton_block_candidates_merge(block_v):
    """Many blocks, k larger than some blocks' share, ties (bf16 rounding): lowest index first."""
    logits = make_logits((2, 300), torch.float32, seed=block_v)
    logits[0, 10] = logits[0, 200] = logits[0].max() + 1  # exact tie across two blocks
    lse = torch.logsumexp(logits / 1.0, -1).float()
    vals, idx = TritonRowOps.topk(logits, 24, 1.0, lse, block_v=block_v)
    assert idx[0, :2].tolist() == [10, 200]
    _check_topk(logits, 24, 1.0, TopKLogprobs(vals, idx, None), f"block_v={block_v}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_token_ids_logprobs_and_gradient(backend, dtype):
    """Support-union log-probs (duplicates allowed) and their gradient wrt logits."""
    logits = make_logits((2, 3, 400), dtype, seed=11)
    ids = torch.randint(0, 400, (2, 3, 6))
    ids[0, 0, 1] = ids[0, 0, 0]  # duplicate id in a row
    x = logits.clone().requires_grad_()
    out = topk_logprobs(x, 4, 1.5, token_ids=ids, backend=backend)
    assert out.token_logprobs is not None and out.token_logprobs.shape == (2, 3, 6)
    assert not out.values.requires_grad
    xr = logits.double().requires_grad_()
    ref = reference_token_logprobs(xr, ids, 1.5)
    assert_close_report(out.token_logprobs, ref, atol=logprob_tol(logits, 1.5), name="token_logprobs")
    g = torch.randn(2, 3, 6, dtype=torch.float64)
    (out.token_logprobs.double() * g).sum().backward()
    (ref * g).sum().backward()
    assert_grad_close(x.grad, xr.grad, name="grad wrt logits")
    _check_topk(logits, 4, 1.5, out, backend)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 3),
    V=st.integers(1, 200),
    k_frac=st.floats(0.0, 1.0),
    scale=st.sampled_from([1e-3, 1.0, 1e4]),
    temperature=st.floats(0.25, 4.0),
    dtype=st.sampled_from(DTYPES),
    backend=st.sampled_from(BACKENDS),
    seed=st.integers(0, 2**16),
)
def test_topk_property(rows, V, k_frac, scale, temperature, dtype, backend, seed):
    k = max(1, min(V, 1 + int(k_frac * min(V, 12))))
    logits = make_logits((rows, V), dtype, scale=scale, seed=seed)
    _check_topk(logits, k, temperature, topk_logprobs(logits, k, temperature, backend=backend), backend)


@pytest.mark.slow
@pytest.mark.interpret_large
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_topk_large(backend, dtype):
    logits = make_logits((4, 151_936), dtype, seed=1)
    _check_topk(logits, 20, 1.0, topk_logprobs(logits, 20, backend=backend), backend)
