"""Peak memory and time of per-token log-probs: naive full logits vs chunked `linear_token_logprobs`.

Why: full `[tokens, vocab]` float32 logits are the classic RL-training OOM. This compares, on
CPU, forward + backward (gradients for hidden and the LM-head weight, with a non-uniform upstream
gradient as GRPO produces) of

  naive:     log_softmax(hidden @ W.T / T).gather(-1, ids)        (full logits, autograd)
  ours:      verst.kernels.linear_token_logprobs(hidden, W, ids, T) (token chunks; the default
             keep-or-recompute choice: recompute here, the logits are 2.3 GiB)
  recompute: the same with keep_logits_max_bytes=0 (the backward recomputes each chunk's logits)
  keep:      the same with an unlimited budget (the forward keeps the [N, V] logits for the backward)

at vocab 151,936, hidden 896, 4,096 tokens, float32 (`--variants` picks; the default is naive,ours). Each variant runs in a fresh Python process
(subprocess) that allocates its inputs first; then the peak resident memory is reset
(`/proc/self/clear_refs`, VmHWM) and also sampled by a thread from `/proc/self/statm`. Reported:
the extra peak above the inputs (max of the two methods; tracemalloc does not see torch's
allocations), and totals (inputs + extra; whole-process peak RSS).

Run (Linux, ~1 min, needs ~8 GiB free RAM):
  uv run python benchmarks/logprob_memory.py
  uv run python benchmarks/logprob_memory.py --tokens 8192 --chunk-size 128 --repeats 3
  # the LM head's backward with and without the recompute, at the vs_trl_scale micro-batch:
  uv run python benchmarks/logprob_memory.py --vocab 49152 --hidden 384 --tokens 1024 \
      --temperature 1.0 --variants recompute,keep --repeats 3

The last line is `peak_memory_ratio=<naive/ours, extra above inputs> time_ratio=<ours/naive>`
(targets: memory ratio >= 8, time ratio <= 1.5) when both are run, then
`keep_over_recompute_time=... keep_over_recompute_memory=...` when both of those are; the
variants alternate within each repeat (the order flips every repeat), and the ratios are
medians of the per-repeat ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

MiB = 1024 * 1024
VARIANTS = ("naive", "ours", "recompute", "keep")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _page_size()


def _page_size() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE")


def _vm_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not found in /proc/self/status")


class _Sampler(threading.Thread):
    """Samples the resident set size every `interval` seconds and keeps the maximum."""

    def __init__(self, interval: float = 0.001) -> None:
        super().__init__(daemon=True)
        self.interval, self.peak, self._stop_evt = interval, 0, threading.Event()

    def run(self) -> None:
        while not self._stop_evt.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(self.interval)

    def stop(self) -> int:
        self._stop_evt.set()
        self.join()
        self.peak = max(self.peak, _rss_bytes())
        return self.peak


def child(args: argparse.Namespace) -> None:
    """One measurement in this (fresh) process; prints one JSON line."""
    import gc

    import torch

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    V, H, N, T = args.vocab, args.hidden, args.tokens, args.temperature
    # inputs first
    weight = (torch.randn(V, H, generator=g) * 0.02).requires_grad_()  # [V, H]
    hidden = torch.randn(N, H, generator=g).requires_grad_()  # [N, H]
    ids = torch.randint(0, V, (N,), generator=g)  # [N]
    upstream = torch.randn(N, generator=g)  # [N] per-token weights (advantages x mask)
    inputs_bytes = sum(t.numel() * t.element_size() for t in (weight, hidden, ids, upstream))
    if args.variant != "naive":
        from verst.kernels import linear_token_logprobs  # import before the baseline is taken
    budget = {"ours": None, "recompute": 0, "keep": 1 << 62}.get(args.variant)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _rss_bytes()
    sampler = _Sampler()
    sampler.start()
    t0 = time.perf_counter()
    if args.variant == "naive":
        lp = torch.log_softmax(hidden @ weight.T / T, dim=-1).gather(-1, ids[:, None]).squeeze(-1)
    else:
        lp = linear_token_logprobs(
            hidden, weight, ids, T, chunk_size=args.chunk_size, backend="torch", keep_logits_max_bytes=budget
        )
    (lp * upstream).sum().backward()
    elapsed = time.perf_counter() - t0
    peak_sampled = sampler.stop()
    peak_hwm = _vm_hwm_bytes()
    peak = max(peak_sampled, peak_hwm)
    print(
        json.dumps(
            {
                "variant": args.variant,
                "seconds": elapsed,
                "inputs_mib": inputs_bytes / MiB,
                "base_rss_mib": base / MiB,
                "extra_hwm_mib": (peak_hwm - base) / MiB,
                "extra_sampled_mib": (peak_sampled - base) / MiB,
                "extra_mib": (peak - base) / MiB,
                "process_peak_mib": peak / MiB,
                "grad_w_norm": float(weight.grad.double().norm()),
            }
        )
    )


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--vocab", str(args.vocab), "--hidden", str(args.hidden),
           "--tokens", str(args.tokens), "--chunk-size", str(args.chunk_size), "--threads", str(args.threads),
           "--temperature", str(args.temperature)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{variant} child failed (rc={out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="runs per variant (alternating); medians reported")
    p.add_argument(
        "--variants", default="naive,ours", help=f"comma-separated, from {','.join(VARIANTS)} (alternated)"
    )
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.variant = args.child
        child(args)
        return
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in VARIANTS for v in variants):
        p.error(f"--variants must name some of {', '.join(VARIANTS)}, got {args.variants!r}")
    print(
        f"V={args.vocab} H={args.hidden} N={args.tokens} float32 chunk={args.chunk_size} threads={args.threads}"
    )
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for i in range(args.repeats):
        for variant in variants if i % 2 == 0 else variants[::-1]:
            r = run_variant(variant, args)
            runs[variant].append(r)
            print(
                f"  {variant:9s} {r['seconds']:7.2f} s  extra {r['extra_mib']:8.0f} MiB "
                f"(VmHWM {r['extra_hwm_mib']:.0f}, sampled {r['extra_sampled_mib']:.0f})  "
                f"inputs {r['inputs_mib']:.0f} MiB  process peak {r['process_peak_mib']:.0f} MiB",
                flush=True,
            )
    report(runs, args.repeats)


def _ratio(runs: dict[str, list[dict]], num: str, den: str, key: str) -> float:
    """Median over repeats of the per-repeat ratio `num / den` of `key`."""
    return statistics.median(a[key] / b[key] for a, b in zip(runs[num], runs[den], strict=True))


def report(runs: dict[str, list[dict]], repeats: int) -> None:
    med = {
        v: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "variant"} for v, rs in runs.items()
    }
    for v, m in med.items():
        print(f"{v}: median {m['seconds']:.2f} s, extra {m['extra_mib']:.0f} MiB (of {repeats})")
    last = []
    if "naive" in med and "ours" in med:
        n, o = med["naive"], med["ours"]
        rel = abs(n["grad_w_norm"] - o["grad_w_norm"]) / n["grad_w_norm"]
        print(f"grad_W norm rel. diff naive vs ours: {rel:.1e}")
        print(
            f"totals (inputs + extra): naive {n['inputs_mib'] + n['extra_mib']:.0f} MiB, ours "
            f"{o['inputs_mib'] + o['extra_mib']:.0f} MiB -> {(n['inputs_mib'] + n['extra_mib']) / (o['inputs_mib'] + o['extra_mib']):.2f}x; "
            f"whole-process peak: {n['process_peak_mib']:.0f} vs {o['process_peak_mib']:.0f} MiB -> "
            f"{n['process_peak_mib'] / o['process_peak_mib']:.2f}x"
        )
        print(f"time: naive {n['seconds']:.2f} s, ours {o['seconds']:.2f} s (median of {repeats})")
        last.append(
            f"peak_memory_ratio={n['extra_mib'] / o['extra_mib']:.2f} "
            f"time_ratio={_ratio(runs, 'ours', 'naive', 'seconds'):.2f}"
        )
    if "keep" in med and "recompute" in med:
        per_pair = [a["seconds"] / b["seconds"] for a, b in zip(runs["keep"], runs["recompute"], strict=True)]
        print(f"keep / recompute time per repeat: {' '.join(f'{x:.3f}' for x in per_pair)}")
        last.append(
            f"keep_over_recompute_time={statistics.median(per_pair):.3f} "
            f"keep_over_recompute_memory={med['keep']['extra_mib'] / med['recompute']['extra_mib']:.2f}"
        )
    if last:
        print(" ".join(last))


if __name__ == "__main__":
    main()
