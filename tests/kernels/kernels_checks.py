"""Shared helpers for the kernel tests: a float64-aware closeness check that names the
mismatching indices, the stated tolerances, and input builders."""

from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps  # 1.19e-7

# Stated tolerances (all against a float64 reference computed from the same rounded inputs, so
# input rounding to bf16/fp16 does not count; only our float32 arithmetic does):
#   log-probs / entropy / top-k values: |err| <= LOGPROB_ATOL + 16 * eps32 * scale
#     where scale = max(1, max |logits / T|)  (log-probs of a row are differences of numbers of
#     that magnitude, so float32 rounding of them is the floor),
#   gradients wrt logits: |err| <= GRAD_ATOL * max|ref| + GRAD_RTOL * |ref|, with the rounding of
#     the output dtype added for bf16/fp16 gradients (which are stored in the input dtype),
#     plus an optional absolute floor set by the caller from the logits' own rounding (a logit
#     off by d moves a probability by ~p * d; a probability rounding to 1 loses (1 - p)), which
#     matters only for badly conditioned rows (|logits| ~ 1e3) whose reference gradient is tiny.
LOGPROB_ATOL = 2e-5
GRAD_ATOL = 2e-5
GRAD_RTOL = 1e-4
OUT_DTYPE_EPS = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def logprob_tol(logits: torch.Tensor, temperature: float) -> float:
    scale = max(1.0, float(logits.double().abs().max()) / temperature) if logits.numel() else 1.0
    return LOGPROB_ATOL + 16 * EPS32 * scale


def assert_close_report(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    atol: float,
    rtol: float = 0.0,
    name: str = "value",
    max_report: int = 8,
) -> None:
    """Assert |actual - expected| <= atol + rtol * |expected| elementwise (float64 comparison).

    On failure the message lists how many elements mismatch, the largest error, and the first
    `max_report` mismatching indices with both values. NaNs must match NaNs.
    """
    assert actual.shape == expected.shape, (
        f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    )
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    both_nan = torch.isnan(a) & torch.isnan(e)
    same_inf = torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))
    err = (a - e).abs()
    bad = ~(both_nan | same_inf) & ~(err <= atol + rtol * e.abs())
    if not bool(bad.any()):
        return
    idx = bad.nonzero().tolist()
    lines = [
        f"{name}: {len(idx)}/{a.numel()} elements outside atol={atol:.3g} rtol={rtol:.3g}; "
        f"max |err| = {float(err[bad].max()):.4g}"
    ]
    for i in idx[:max_report]:
        t = tuple(i)
        lines.append(
            f"  at {t}: actual={float(a[t]):.9g} expected={float(e[t]):.9g} |err|={float(err[t]):.3g}"
        )
    raise AssertionError("\n".join(lines))


def assert_grad_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    name: str,
    extra_rel: float = 0.0,
    floor: float = 0.0,
) -> None:
    """Gradient check: absolute tolerance relative to the largest reference entry, at least `floor`."""
    scale = float(expected.detach().double().abs().max()) if expected.numel() else 1.0
    eps = OUT_DTYPE_EPS.get(actual.dtype, 0.0)
    assert_close_report(
        actual,
        expected,
        atol=max((GRAD_ATOL + extra_rel + eps) * max(scale, 1e-30), floor),
        rtol=GRAD_RTOL + eps,
        name=name,
    )


def make_logits(
    shape: tuple[int, ...], dtype: torch.dtype, *, scale: float = 3.0, seed: int = 0
) -> torch.Tensor:
    """Random logits of the given magnitude, rounded to `dtype` (the reference uses the rounded values)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    return x.clamp(-6e4, 6e4).to(dtype)
