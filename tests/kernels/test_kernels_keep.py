"""The chunked linear path keeping the forward's logits for the backward (`keep_logits_max_bytes`).

Kept or recomputed, the backward sees the same logits, so log-probs, entropy, top-k and every
gradient must be the same; the logits are kept only within the byte budget and only when a
gradient will be asked for, and a kept backward does no logits matmul.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from verst.kernels import KEEP_LOGITS_MAX_BYTES, linear_token_logprobs, linear_topk_logprobs

BACKENDS = ["torch", "triton"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KEEP, RECOMPUTE = 1 << 62, 0


def _inputs(N, H, V, dtype, seed, with_bias):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn((N, H), generator=g, dtype=torch.float64) * 2).to(dtype)
    weight = (torch.randn((V, H), generator=g, dtype=torch.float64) / H**0.5).to(dtype)
    bias = torch.randn(V, generator=g, dtype=torch.float64).to(dtype) if with_bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, bias, targets


def _run(budget, backend, hidden, weight, bias, targets, T, chunk, softcap, entropy, topk):
    """Outputs and the gradients of two different backwards through one graph."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = bias.clone().requires_grad_() if bias is not None else None
    kw = dict(
        chunk_size=chunk, backend=backend, lm_head_bias=b, softcap=softcap, keep_logits_max_bytes=budget
    )
    if topk:
        ids = torch.stack([targets, targets.flip(0)], -1)  # [N, 2]
        out = linear_topk_logprobs(h, w, topk, T, token_ids=ids, **kw)
        outs, losses = (out.values, out.indices, out.token_logprobs), [out.token_logprobs.sum()]
    else:
        lp, ent = linear_token_logprobs(h, w, targets, T, True, **kw)
        outs = (lp, ent)
        losses = [(lp * torch.linspace(-1, 2, lp.numel())).sum() + (0.3 * ent.sum() if entropy else 0)]
    losses.append(-(torch.exp(outs[-1 if topk else 0].sum() * 0.1)))  # a second, different upstream
    grads = []
    for loss in losses:
        grads += torch.autograd.grad(loss, [t for t in (h, w, b) if t is not None], retain_graph=True)
    return [o.detach() for o in outs], grads


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    N=st.integers(1, 9),
    H=st.integers(1, 8),
    V=st.integers(2, 70),
    chunk=st.integers(1, 5),
    T=st.sampled_from([0.5, 1.0, 1.7]),
    dtype=st.sampled_from(DTYPES),
    backend=st.sampled_from(BACKENDS),
    with_bias=st.booleans(),
    softcap=st.sampled_from([None, 2.0]),
    entropy=st.booleans(),
    topk=st.sampled_from([0, 0, 2]),
    seed=st.integers(0, 2**16),
)
def test_kept_logits_give_the_recompute_results(
    N, H, V, chunk, T, dtype, backend, with_bias, softcap, entropy, topk, seed
):
    hidden, weight, bias, targets = _inputs(N, H, V, dtype, seed, with_bias)
    args = (backend, hidden, weight, bias, targets, T, chunk, softcap, entropy, min(topk, V))
    kept_out, kept_grads = _run(KEEP, *args)
    re_out, re_grads = _run(RECOMPUTE, *args)
    assert len(kept_out) == len(re_out) and len(kept_grads) == len(re_grads)
    pairs = [(f"output {i}", a, b) for i, (a, b) in enumerate(zip(kept_out, re_out, strict=True))]
    pairs += [(f"gradient {i}", a, b) for i, (a, b) in enumerate(zip(kept_grads, re_grads, strict=True))]
    for name, a, b in pairs:
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name}: max |diff| {(a.double() - b.double()).abs().max():.3g}"


class _Ops(TorchDispatchMode):
    """Records every aten op's name and its largest floating-point output."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        size = max(
            (t.numel() for t in outs if isinstance(t, torch.Tensor) and t.dtype.is_floating_point), default=0
        )
        self.calls.append((func.overloadpacket.__name__, size))
        return out

    def largest(self) -> int:
        return max(size for _, size in self.calls)

    def matmuls(self) -> int:
        return sum(name in ("mm", "addmm", "addmm_") for name, _ in self.calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_budget_decides_and_a_kept_backward_does_no_logits_matmul(dtype):
    N, H, V, chunk = 24, 8, 300, 8
    hidden, weight, _, targets = _inputs(N, H, V, dtype, 3, False)
    full = N * V * weight.element_size()  # bytes of the [N, V] logits
    for budget, kept in [(full, True), (full - 1, False), (0, False), (None, True)]:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with _Ops() as fwd:
            lp = linear_token_logprobs(
                h, w, targets, 0.9, chunk_size=chunk, backend="torch", keep_logits_max_bytes=budget
            )
        with _Ops() as bwd:
            (lp * torch.randn(N)).sum().backward()
        chunks = N // chunk
        assert fwd.matmuls() == chunks
        assert (fwd.largest() == N * V) is kept, f"budget {budget}: largest forward output {fwd.largest()}"
        # per chunk: grad_hidden and grad_weight, plus the logits again unless they were kept
        assert bwd.matmuls() == chunks * (2 if kept else 3), f"budget {budget}"
        assert bwd.largest() <= max(chunk * V, V * H)


def test_nothing_is_kept_without_a_gradient():
    N, H, V = 16, 4, 200
    hidden, weight, _, targets = _inputs(N, H, V, torch.float32, 4, False)
    with _Ops() as ops, torch.no_grad():
        linear_token_logprobs(hidden.clone().requires_grad_(), weight, targets, chunk_size=4)
    assert ops.largest() <= 4 * V
    with _Ops() as ops:  # no input requires a gradient
        linear_token_logprobs(hidden, weight, targets, chunk_size=4)
    assert ops.largest() <= 4 * V
    with _Ops() as ops:  # top-k without token_ids: nothing differentiable
        linear_topk_logprobs(hidden.clone().requires_grad_(), weight, 3, chunk_size=4)
    assert ops.largest() <= 4 * V


def test_the_budget_is_checked_and_its_default_documented():
    hidden, weight, _, targets = _inputs(3, 4, 10, torch.float32, 1, False)
    with pytest.raises(ValueError, match="keep_logits_max_bytes must be >= 0"):
        linear_token_logprobs(hidden, weight, targets, keep_logits_max_bytes=-1)
    assert KEEP_LOGITS_MAX_BYTES == 256 * 2**20
