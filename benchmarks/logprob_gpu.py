"""GPU timing of the verst log-prob kernels: Triton vs torch implementation vs naive full logits.

Why: on GPU these ops are memory-bound (each reads a [tokens, vocab] logits array), so the right
yardstick is achieved bandwidth against a plain device-to-device copy measured in the same run,
and the chunked linear path must keep its memory saving without losing time to the naive
`log_softmax(h @ W.T / T).gather(...)`.

Measured with CUDA events (warm-up, then the median of `--iters`), per case:
  token_logprobs fwd / fwd+bwd (+entropy), topk_logprobs (k=20) and linear_token_logprobs fwd+bwd,
  each for backend="triton", backend="torch" and the naive torch expression; bandwidth counts the
  logits bytes each variant must at least move (fwd: read V per row; fwd+bwd: + read + write
  grad), and peak extra memory (torch.cuda.max_memory_allocated above the inputs).

Run (needs a CUDA device; ~1 min):
  uv run python benchmarks/logprob_gpu.py
  uv run python benchmarks/logprob_gpu.py --tokens 16384 --dtype float32
Smoke-run of the script logic on CPU (Triton interpreted, tiny shapes, times meaningless):
  TRITON_INTERPRET=1 uv run python benchmarks/logprob_gpu.py --device cpu --tokens 8 --vocab 3000 --hidden 16 --iters 1

Last line: `triton_fwd_bw_vs_copy=<fraction> triton_fwd_speedup_vs_naive=<x> linear_peak_memory_ratio=<naive/ours> linear_time_ratio=<ours/naive>`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from verst.kernels import linear_token_logprobs, token_logprobs, topk_logprobs

GiB = 1024**3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 2) -> float:
    """Median milliseconds of fn() (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> float:
    """Peak allocated bytes above what was allocated before fn() (CUDA only; NaN elsewhere)."""
    if device.type != "cuda":
        return float("nan")
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    _sync(device)
    return float(torch.cuda.max_memory_allocated(device) - base)


Record = Callable[[str, str, Callable[[], object], float], tuple[float, float]]


def measure_copy(logits: torch.Tensor, device: torch.device, iters: int) -> float:
    """Bandwidth (bytes/s) of a device-to-device copy of a logits-sized array (read + write)."""
    dst = torch.empty_like(logits)
    copy_ms = time_ms(lambda: dst.copy_(logits), device, iters)
    bw = 2 * logits.numel() * logits.element_size() / (copy_ms * 1e-3)
    print(f"device-to-device copy of the logits: {copy_ms:.3f} ms, {bw / 1e9:.1f} GB/s")
    return bw


def logits_cases(
    logits: torch.Tensor, ids: torch.Tensor, upstream: torch.Tensor, T: float, k: int, record: Record
) -> dict[str, tuple[float, float]]:
    """token_logprobs fwd, fwd+bwd with entropy, topk: triton / torch / naive. Returns the fwd rows."""
    nbytes = logits.numel() * logits.element_size()

    def naive_fwd(x):
        return torch.log_softmax(x.float() / T, -1).gather(-1, ids[:, None]).squeeze(-1)

    fwd = {}
    with torch.no_grad():
        for b in ("triton", "torch"):
            fwd[b] = record(
                "token_logprobs fwd", b, lambda b=b: token_logprobs(logits, ids, T, backend=b), nbytes
            )
        fwd["naive"] = record("token_logprobs fwd", "naive", lambda: naive_fwd(logits), nbytes)

    x = logits.clone().requires_grad_()

    def fwd_bwd(b):
        x.grad = None
        lp, ent = token_logprobs(x, ids, T, True, backend=b)
        ((lp * upstream).sum() + ent.sum() * 0.01).backward()

    def naive_fwd_bwd():
        x.grad = None
        logp = torch.log_softmax(x.float() / T, -1)
        ent = -(logp.exp() * logp).sum(-1)
        ((logp.gather(-1, ids[:, None]).squeeze(-1) * upstream).sum() + ent.sum() * 0.01).backward()

    for b in ("triton", "torch"):
        record("token_logprobs+entropy fwd+bwd", b, lambda b=b: fwd_bwd(b), 3 * nbytes)
    record("token_logprobs+entropy fwd+bwd", "naive", naive_fwd_bwd, 3 * nbytes)

    with torch.no_grad():
        for b in ("triton", "torch"):
            record(f"topk_logprobs k={k}", b, lambda b=b: topk_logprobs(logits, k, T, backend=b), 2 * nbytes)
        record(
            f"topk_logprobs k={k}", "naive", lambda: torch.log_softmax(logits.float() / T, -1).topk(k), nbytes
        )
    return fwd


def linear_cases(
    N: int, V: int, H: int, dtype: torch.dtype, device: torch.device, g: torch.Generator,
    ids: torch.Tensor, upstream: torch.Tensor, T: float, chunk: int, logits_bytes: int, record: Record,
) -> dict[str, tuple[float, float]]:  # fmt: skip
    """linear_token_logprobs fwd+bwd (grads for hidden and weight): triton / torch / naive."""
    hidden = torch.randn(N, H, device=device, dtype=dtype, generator=g).requires_grad_()  # [N, H]
    weight = (torch.randn(V, H, device=device, dtype=dtype, generator=g) * H**-0.5).requires_grad_()  # [V, H]

    def lin(b):
        hidden.grad = weight.grad = None
        lp = linear_token_logprobs(hidden, weight, ids, T, chunk_size=chunk, backend=b)
        (lp * upstream).sum().backward()

    def lin_naive():
        hidden.grad = weight.grad = None
        lp = torch.log_softmax((hidden @ weight.T).float() / T, -1).gather(-1, ids[:, None]).squeeze(-1)
        (lp * upstream).sum().backward()

    out = {
        b: record("linear_token_logprobs fwd+bwd", b, lambda b=b: lin(b), 3 * logits_bytes)
        for b in ("triton", "torch")
    }
    out["naive"] = record("linear_token_logprobs fwd+bwd", "naive", lin_naive, 3 * logits_bytes)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark is for GPUs (see --device cpu for a smoke run)")
    dtype = getattr(torch, args.dtype)
    N, V, H, T, iters = args.tokens, args.vocab, args.hidden, args.temperature, args.iters
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(N, V, device=device, dtype=dtype, generator=g) * 3  # [N, V]
    ids = torch.randint(0, V, (N,), device=device, generator=g)  # [N]
    upstream = torch.randn(N, device=device, generator=g)  # [N]
    elt = logits.element_size()
    logits_bytes = N * V * elt
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device={name} N={N} V={V} H={H} dtype={args.dtype} T={T} k={args.k} chunk={args.chunk_size}")

    copy_bw = measure_copy(logits, device, iters)
    rows: list[tuple[str, str, float, float, float]] = []  # (case, variant, ms, GB/s, peak bytes)

    def record(case: str, variant: str, fn: Callable[[], object], min_bytes: float) -> tuple[float, float]:
        ms = time_ms(fn, device, iters)
        peak = peak_extra_bytes(fn, device)
        rows.append((case, variant, ms, min_bytes / (ms * 1e-3), peak))
        return ms, peak

    fwd = logits_cases(logits, ids, upstream, T, args.k, record)
    del logits
    lin = linear_cases(N, V, H, dtype, device, g, ids, upstream, T, args.chunk_size, logits_bytes, record)
    print(f"{'case':34s} {'variant':7s} {'ms':>9s} {'GB/s':>8s} {'of copy':>8s} {'peak extra GiB':>15s}")
    for case, variant, ms, bw, peak in rows:
        print(f"{case:34s} {variant:7s} {ms:9.3f} {bw / 1e9:8.1f} {bw / copy_bw:8.2f} {peak / GiB:15.2f}")
    fwd_bw_frac = logits_bytes / (fwd["triton"][0] * 1e-3) / copy_bw
    print(
        f"triton_fwd_bw_vs_copy={fwd_bw_frac:.2f} triton_fwd_speedup_vs_naive={fwd['naive'][0] / fwd['triton'][0]:.2f} "
        f"linear_peak_memory_ratio={lin['naive'][1] / lin['triton'][1]:.2f} "
        f"linear_time_ratio={lin['triton'][0] / lin['naive'][0]:.2f}"
    )


if __name__ == "__main__":
    main()
