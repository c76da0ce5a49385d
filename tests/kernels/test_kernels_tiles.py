"""The torch backend's vocabulary tiles (`verst.kernels._tiles`): several token blocks and
vocabulary slices per call give the float64 results, kept logits still give the recompute's
bits, and a tile never holds more than a `[chunk_size, V]` chunk's elements."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernels_checks import OUT_DTYPE_EPS, assert_close_report, assert_grad_close
from test_kernels_keep import KEEP, RECOMPUTE, _run
from test_kernels_keep import _inputs as _keep_inputs
from test_kernels_linear import _check, _inputs, _tol

from verst.kernels import linear_token_logprobs, linear_topk_logprobs
from verst.kernels._tiles import TILE_CHUNKS, tile_shape
from verst.kernels.reference import reference_linear_token_logprobs

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@given(n=st.integers(1, 100_000), v=st.integers(1, 300_000), chunk=st.integers(1, 5_000))
def test_a_tile_holds_at_most_a_chunk(n, v, chunk):
    rows, cols = tile_shape(n, v, chunk)
    assert 1 <= rows <= min(n, TILE_CHUNKS * chunk) and 1 <= cols <= v
    assert rows * cols <= chunk * v
    if n <= chunk:  # a single token chunk: the whole vocabulary in one tile, as before tiles
        assert (rows, cols) == (n, v)
    assert tile_shape(4096, 151_936, 256) == (4096, 9_496)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    N=st.integers(1, 60),
    H=st.integers(1, 8),
    V=st.integers(1, 130),
    chunk=st.integers(1, 4),  # tiles of up to 16 * chunk tokens: several token blocks at N > 16 * chunk
    scale=st.sampled_from([1e-2, 1.0, 1e3]),
    temperature=st.floats(0.25, 4.0),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_tiles_match_float64(N, H, V, chunk, scale, temperature, dtype, seed):
    """Log-probs, entropy and the gradients of hidden and weight, any number of tiles."""
    hidden, weight, targets = _inputs((N,), H, V, dtype, seed=seed, scale=scale)
    _check(hidden, weight, targets, temperature, chunk, "torch", seed=seed)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    N=st.integers(17, 45),
    H=st.integers(1, 6),
    V=st.integers(2, 90),
    chunk=st.integers(1, 2),
    T=st.sampled_from([0.5, 1.7]),
    dtype=st.sampled_from(DTYPES),
    with_bias=st.booleans(),
    softcap=st.sampled_from([None, 2.0]),
    entropy=st.booleans(),
    topk=st.sampled_from([0, 3]),
    seed=st.integers(0, 2**16),
)
def test_kept_tiles_give_the_recompute_bits(
    N, H, V, chunk, T, dtype, with_bias, softcap, entropy, topk, seed
):
    """Several token blocks and vocabulary slices: kept or recomputed, the same bits."""
    hidden, weight, bias, targets = _keep_inputs(N, H, V, dtype, seed, with_bias)
    args = ("torch", hidden, weight, bias, targets, T, chunk, softcap, entropy, min(topk, V))
    kept_out, kept_grads = _run(KEEP, *args)
    re_out, re_grads = _run(RECOMPUTE, *args)
    for i, (a, b) in enumerate(zip([*kept_out, *kept_grads], [*re_out, *re_grads], strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        assert torch.equal(a, b), f"{i}: max |diff| {(a.double() - b.double()).abs().max():.3g}"


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    N=st.integers(1, 40),
    V=st.integers(8, 200),
    k=st.integers(1, 8),
    chunk=st.integers(1, 3),
    with_bias=st.booleans(),
    softcap=st.sampled_from([None, 1.5]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_tiled_topk_bias_and_softcap_match_float64(N, V, k, chunk, with_bias, softcap, dtype, seed):
    """Top-k merged across vocabulary slices, and the bias / soft-cap gradients, per tile."""
    H = 6
    hidden, weight, _, _ = _keep_inputs(N, H, V, dtype, seed, False)
    g = torch.Generator().manual_seed(seed + 1)
    bias = (torch.randn(V, generator=g, dtype=torch.float64) * 2).to(dtype) if with_bias else None
    ids = torch.randint(0, V, (N, 2), generator=g)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = bias.clone().requires_grad_() if bias is not None else None
    out = linear_topk_logprobs(
        h, w, k, 0.8, token_ids=ids, chunk_size=chunk, backend="torch", lm_head_bias=b, softcap=softcap
    )
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    br = bias.double().requires_grad_() if bias is not None else None
    full = reference_linear_token_logprobs(
        hr, wr, torch.arange(V).expand(N, V), 0.8, lm_head_bias=br, softcap=softcap
    )  # [N, V]
    tol = _tol(hidden, weight, 0.8) + (4 * OUT_DTYPE_EPS[dtype] * float(bias.abs().max()) if with_bias else 0)
    assert_close_report(out.values, full.detach().topk(k, -1).values, atol=tol, name="top-k values")
    assert_close_report(out.values, full.detach().gather(-1, out.indices), atol=tol, name="value@index")
    ref = full.gather(-1, ids)
    assert_close_report(out.token_logprobs, ref, atol=tol, name="token_logprobs")
    up = torch.randn(N, 2, generator=g, dtype=torch.float64)
    (out.token_logprobs.double() * up).sum().backward()
    (ref * up).sum().backward()
    extra = 8 * OUT_DTYPE_EPS[dtype]
    assert_grad_close(h.grad, hr.grad, name="grad_hidden", extra_rel=extra)
    assert_grad_close(w.grad, wr.grad, name="grad_weight", extra_rel=extra)
    if b is not None and br is not None:
        assert_grad_close(b.grad, br.grad, name="grad_bias", extra_rel=extra)


def test_no_tokens_give_zero_gradients():
    """`grad_W` is written by the token blocks, not zero-filled first: with no tokens it is zero."""
    h = torch.zeros((0, 4), requires_grad=True)
    w = torch.randn(30, 4, requires_grad=True)
    lp = linear_token_logprobs(h, w, torch.zeros(0, dtype=torch.int64), chunk_size=2, backend="torch")
    lp.sum().backward()
    assert lp.shape == (0,) and torch.equal(w.grad, torch.zeros_like(w)) and h.grad.shape == (0, 4)
