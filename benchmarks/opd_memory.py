"""Peak memory of top-k OPD vs sampled-token OPD at a 151,936 vocabulary and 4,096 tokens (CPU).

Why: top-k OPD needs, at every response position, the student's and the teacher's top-k over
the whole vocabulary. Done naively that is two `[tokens, vocab]` float32 tensors (2.3 GiB each
here) plus their softmax and gradient. verst computes both sides with the chunked kernels
(`verst.kernels.linear_topk_logprobs`), so only `[tokens, k]` tensors exist; the claim is that
top-k OPD costs at most 2x the memory of sampled-token OPD, which needs only per-token log-probs.

Each variant runs the train side's calls of one micro-batch, in a fresh Python process, with a
trainer teacher (the teacher's hidden states and LM head are inputs, like the student's):

  sampled: teacher log-probs of the sampled tokens (no grad, `linear_token_logprobs`), the
           student's (`linear_token_logprobs`, fwd + bwd) with advantages
           `-(student_logp - teacher_logp)` — what `OpdTrainer.fold_advantages` feeds the loss.
  topk:    the student's no-grad pre-pass (`linear_topk_logprobs`: top-k ids), the teacher's top-k
           and its log-probs of the student's ids (`linear_topk_logprobs(token_ids=...)`), then
           the student's sampled-token log-probs (policy loss) and its log-probs of the 2k
           candidates (`linear_topk_logprobs(token_ids=...)`, fwd + bwd), `topk_opd_kl` — what
           `OpdTrainer.prepare` + `forward_with_kl` do.

The peak is measured as in `benchmarks/logprob_memory.py` (its helpers are imported): after the
inputs are allocated, VmHWM is reset and `/proc/self/statm` is sampled by a thread; reported is
the extra peak above the inputs.

Run (Linux, a few minutes on 2 cores, ~4 GiB free RAM):
  uv run python benchmarks/opd_memory.py
  uv run python benchmarks/opd_memory.py --k 64 --tokens 4096 --vocab 151936

Last line: `topk_over_sampled_memory=<topk extra peak / sampled extra peak>` (target <= 2).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from logprob_memory import MiB, _rss_bytes, _Sampler, _vm_hwm_bytes


def child(args: argparse.Namespace) -> None:
    """One measurement in this (fresh) process; prints one JSON line."""
    import gc

    import torch

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    V, H, N, T, k = args.vocab, args.hidden, args.tokens, args.temperature, args.k
    w_s = (torch.randn(V, H, generator=g) * 0.02).requires_grad_()  # [V, H] student LM head
    h_s = torch.randn(N, H, generator=g).requires_grad_()  # [N, H] student hidden states
    w_t = torch.randn(V, H, generator=g) * 0.02  # [V, H] teacher LM head
    h_t = torch.randn(N, H, generator=g)  # [N, H] teacher hidden states
    ids = torch.randint(0, V, (N,), generator=g)  # [N] sampled tokens
    inputs_bytes = sum(t.numel() * t.element_size() for t in (w_s, h_s, w_t, h_t, ids))
    from verst.kernels import linear_token_logprobs, linear_topk_logprobs
    from verst.trainer.opd.token_sets import TopKSides, topk_opd_kl

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _rss_bytes()
    sampler = _Sampler()
    sampler.start()
    t0 = time.perf_counter()
    chunk = args.chunk_size
    if args.variant == "sampled":
        with torch.no_grad():
            t_lp = linear_token_logprobs(h_t, w_t, ids, T, chunk_size=chunk)  # [N]
            old = linear_token_logprobs(h_s, w_s, ids, T, chunk_size=chunk)  # [N]
        lp = linear_token_logprobs(h_s, w_s, ids, T, chunk_size=chunk)  # [N]
        adv = -(old - t_lp)  # [N]
        loss = -(adv * lp).mean()
    else:
        with torch.no_grad():
            s_top = linear_topk_logprobs(h_s, w_s, k, T, chunk_size=chunk)  # ids [N, k]
            t_top = linear_topk_logprobs(h_t, w_t, k, T, token_ids=s_top.indices, chunk_size=chunk)
        lp = linear_token_logprobs(h_s, w_s, ids, T, chunk_size=chunk)  # [N] policy loss
        cand = torch.cat([s_top.indices, t_top.indices], dim=-1)  # [N, 2k]
        both = linear_topk_logprobs(h_s, w_s, 1, T, token_ids=cand, chunk_size=chunk).token_logprobs
        sides = TopKSides(
            student_ids=s_top.indices,
            student_logp=both[:, :k],
            teacher_ids=t_top.indices,
            teacher_logp=t_top.values,
            student_logp_on_teacher_ids=both[:, k:],
            teacher_logp_on_student_ids=t_top.token_logprobs,
        )
        kl = topk_opd_kl(sides, args.token_set, "student")  # [N]
        loss = -(lp * 0.0).mean() + kl.mean()
    loss.backward()
    elapsed = time.perf_counter() - t0
    peak_sampled = sampler.stop()
    peak = max(peak_sampled, _vm_hwm_bytes())
    print(
        json.dumps(
            {
                "variant": args.variant,
                "seconds": elapsed,
                "inputs_mib": inputs_bytes / MiB,
                "extra_mib": (peak - base) / MiB,
                "process_peak_mib": peak / MiB,
                "grad_finite": bool(torch.isfinite(w_s.grad).all()),
            }
        )
    )


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--vocab", str(args.vocab), "--hidden", str(args.hidden),
           "--tokens", str(args.tokens), "--k", str(args.k), "--chunk-size", str(args.chunk_size),
           "--threads", str(args.threads), "--temperature", str(args.temperature), "--token-set", args.token_set]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{variant} child failed (rc={out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--token-set", default="union")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", choices=["sampled", "topk"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.variant = args.child
        child(args)
        return
    print(
        f"V={args.vocab} H={args.hidden} N={args.tokens} k={args.k} token_set={args.token_set} float32 "
        f"chunk={args.chunk_size} threads={args.threads}; a full [N, V] float32 tensor = "
        f"{args.tokens * args.vocab * 4 / MiB:.0f} MiB"
    )
    res = {}
    for variant in ("sampled", "topk"):
        r = res[variant] = run_variant(variant, args)
        print(
            f"  {variant:7s} {r['seconds']:7.1f} s  extra peak {r['extra_mib']:7.0f} MiB  "
            f"inputs {r['inputs_mib']:.0f} MiB  process peak {r['process_peak_mib']:.0f} MiB  "
            f"grads finite {r['grad_finite']}"
        )
    s, t = res["sampled"], res["topk"]
    print(
        f"totals (inputs + extra): sampled {s['inputs_mib'] + s['extra_mib']:.0f} MiB, "
        f"topk {t['inputs_mib'] + t['extra_mib']:.0f} MiB; time topk/sampled {t['seconds'] / s['seconds']:.2f}x"
    )
    print(f"topk_over_sampled_memory={t['extra_mib'] / max(s['extra_mib'], 1e-9):.2f}")


if __name__ == "__main__":
    main()
