"""Fully-async vs synchronous training on the reverse-digits example, same samples, same machine.

Why: fully-async rollout (`rollout.fully_async`) exists to overlap generation with training —
the producer keeps generating the next batches while the trainer runs its step and the weight
sync. This measures what that buys on this machine, and what it costs in learning (eval
reward after the same number of samples; async trains on samples up to
`max_weight_staleness` versions old, corrected by truncated IS, on by default).

Setup (both modes identical except `rollout.fully_async`): `examples/reverse_digits/config.toml`
from the SFT warm start; the embedded engine is served by `verst serve` in its own process
(started fresh for every run, so both start from the same weights) and reached through the
SGLang client (`engine.type = "sglang"`); weights go to it from disk after every step; one
torch thread per process (two processes share the cores); greedy eval on the 300 held-out
prompts at the start and end (not timed). Timed: the training loop, the sum of `time/step_s`
(rollout wait + train step + weight sync) over all steps.

Two scenarios: `plain` (generation as fast as the engine is) and `long_tail` (the server
delays a seeded random fraction of requests: `--inject-latency-ms/--inject-latency-fraction`),
where a synchronous step waits for its slowest request and the async producer does not.

Run (about 5–10 min on 2 cores with the defaults):
  uv run python benchmarks/async_vs_sync.py
  uv run python benchmarks/async_vs_sync.py --steps 60 --latency-ms 500 --latency-fraction 0.05

The last line is `async_speedup=<sync_time/async_time> async_eval_reward=<x> sync_eval_reward=<y>`
(plain scenario); the long-tail line comes just before it.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "reverse_digits"
CONFIG = EXAMPLE / "config.toml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`verst serve` on the warm-start model in a child process (one torch thread)."""

    def __init__(self, model: Path, latency_ms: float, fraction: float, seed: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "verst.rollout.engines.serve.server",
            "--model",
            str(model),
            "--port",
            str(self.port),
            "--num-threads",
            "1",
            "--max-batch-size",
            "64",
            "--inject-latency-ms",
            str(latency_ms),
            "--inject-latency-fraction",
            str(fraction),
            "--inject-latency-seed",
            str(seed),
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"verst serve exited: {self.proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        self.close()
        raise RuntimeError("verst serve did not become healthy within 120 s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class StepLogger:
    """Keeps every step's metrics (the controller's MetricsLogger surface)."""

    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, float]]] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.records.append((step, dict(metrics)))

    def phase(self, name: str) -> None:
        pass

    def close(self) -> None:
        pass


def run_once(args: argparse.Namespace, *, fully_async: bool, latency_ms: float, out: Path) -> dict[str, Any]:
    from verst.trainer.cli import load_config_and_env
    from verst.trainer.run.controller import run_training

    overrides = [
        f"run.num_steps={args.steps}",
        f'run.output_dir="{out}"',
        "run.save_interval=0",
        "run.keep_checkpoints=1",
        "run.resume=false",
        "engine={}",  # set below, once the server is up (a whole table: the example's is embedded)
        "train.num_threads=1",
        "rollout.eval.interval=0",
        f"rollout.fully_async={'true' if fully_async else 'false'}",
    ]
    if fully_async:  # the fully-async strategy's own options
        overrides += [
            f"rollout.strategy_options.async_buffer_groups={args.buffer}",
            f"rollout.strategy_options.max_weight_staleness={args.staleness}",
        ]
    fraction = args.latency_fraction if latency_ms > 0 else 0.0
    server = Server(EXAMPLE / "model" / "warm_start", latency_ms, fraction, args.seed)
    try:
        overrides[5] = f'engine={{type = "sglang", urls = ["{server.url}"]}}'
        cfg, env = load_config_and_env(str(CONFIG), overrides)
        logger = StepLogger()
        t0 = time.perf_counter()
        summary = run_training(cfg, out, env=env, logger=logger)
        wall = time.perf_counter() - t0
    finally:
        server.close()
    steps = [m for _, m in logger.records if "time/step_s" in m]
    evals = summary.eval_history
    key = next(k for k in evals[-1][1] if k.endswith("/reward_mean"))

    def total(name: str) -> float:
        return sum(m.get(name, 0.0) for m in steps)

    return {
        "mode": "async" if fully_async else "sync",
        "latency_ms": latency_ms,
        "steps": len(steps),
        "samples": int(total("rollout/kept_groups")) * cfg.rollout.n_samples_per_prompt,
        "loop_s": total("time/step_s"),
        "rollout_wait_s": total("time/rollout_s"),
        "train_s": total("time/train_s"),
        "sync_s": total("time/sync_s"),
        "wall_s": wall,
        "eval_start": evals[0][1][key],
        "eval_end": evals[-1][1][key],
        "train_reward_last10": sum(m.get("rollout/reward_mean", 0.0) for m in steps[-10:])
        / max(1, len(steps[-10:])),
        "staleness_mean": total("rollout/staleness_mean") / max(1, len(steps)),
        "stale_retried": total("rollout/stale_retried"),
        "stale_dropped": total("rollout/stale_dropped"),
        "tis": cfg.algorithm.tis,
    }


def compare(args: argparse.Namespace, latency_ms: float, tmp: Path, label: str) -> tuple[dict, dict]:
    results = {}
    for fully_async in (False, True):
        mode = "async" if fully_async else "sync"
        r = run_once(args, fully_async=fully_async, latency_ms=latency_ms, out=tmp / f"{label}_{mode}")
        results[mode] = r
        print(
            f"[{label}] {json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})}"
        )
        sys.stdout.flush()
    return results["sync"], results["async"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="training steps per run (default 40)")
    p.add_argument(
        "--buffer", type=int, default=16, help="rollout.strategy_options.async_buffer_groups (default 16)"
    )
    p.add_argument(
        "--staleness", type=int, default=1, help="rollout.strategy_options.max_weight_staleness (default 1)"
    )
    p.add_argument("--latency-ms", type=float, default=500.0, help="long_tail: mean injected delay (ms)")
    p.add_argument("--latency-fraction", type=float, default=0.05, help="long_tail: fraction delayed")
    p.add_argument("--seed", type=int, default=0, help="seed of the injected delays")
    p.add_argument("--only", choices=["plain", "long_tail"], default=None, help="run one scenario only")
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)
    rows: list[tuple[str, dict]] = []
    lines = []
    plain = None
    with tempfile.TemporaryDirectory(prefix="verst-async-bench-") as tmp_dir:
        tmp = Path(tmp_dir)
        if args.only in (None, "long_tail"):
            sync, fa = compare(args, args.latency_ms, tmp, "long_tail")
            rows += [("long_tail", sync), ("long_tail", fa)]
            lines.append(
                f"long_tail ({args.latency_ms:g} ms x {args.latency_fraction:g} of requests): "
                f"async_speedup={sync['loop_s'] / fa['loop_s']:.2f} "
                f"async_eval_reward={fa['eval_end']:.3f} sync_eval_reward={sync['eval_end']:.3f}"
            )
        if args.only in (None, "plain"):
            plain = compare(args, 0.0, tmp, "plain")
            rows += [("plain", plain[0]), ("plain", plain[1])]
    print()
    print(
        "| scenario | mode | samples | loop s | rollout wait s | train s | sync s | eval start → end | staleness mean |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for scenario, r in rows:
        print(
            f"| {scenario} | {r['mode']} | {r['samples']} | {r['loop_s']:.1f} | {r['rollout_wait_s']:.1f} | "
            f"{r['train_s']:.1f} | {r['sync_s']:.1f} | {r['eval_start']:.3f} → {r['eval_end']:.3f} | "
            f"{r['staleness_mean']:.2f} |"
        )
    for line in lines:
        print(line)
    if plain is not None:
        sync, fa = plain
        print(
            f"async_speedup={sync['loop_s'] / fa['loop_s']:.2f} "
            f"async_eval_reward={fa['eval_end']:.3f} sync_eval_reward={sync['eval_end']:.3f}"
        )


if __name__ == "__main__":
    main()
