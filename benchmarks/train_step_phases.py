"""Where verst's GRPO step spends its time at `vs_trl.py`'s settings, phase by phase.

Why: at the tiny reverse-digits scale (0.67M parameters, 64 sequences of ≤ 12 new tokens) a
step is ~100 ms and the framework's own Python (batch build, layout, loss, metrics, recording,
the optimizer wrappers, the weight sync) is a visible share of it; issue #29 wants verst within
1.10× of the fair floor. This script runs the real `Trainer` (the same overrides as `vs_trl.py`)
and wraps the step's pieces with timers — wall and CPU time (`time.process_time`, steadier on a
shared box) — so a change to one of them can be measured on its own, and cProfiles the train
side (`--profile`).

    uv run python benchmarks/train_step_phases.py --steps 30 --threads 1
    uv run python benchmarks/train_step_phases.py --steps 30 --profile 40   # + top-40 cProfile

The pieces are wrapped by name where they exist (a piece missing in some version of the code
is skipped), so the same script times old and new code for A/B comparisons. A profiling aid,
not a benchmark against a baseline: the A/B is two runs of it, old code and new. It prints one
JSON object (per phase the median wall and CPU milliseconds per step after `--warmup` steps;
`step`: wall is the controller's own `time/step_s`, CPU the whole step's, every thread's), then
the last line `step_wall_ms=<x> step_cpu_ms=<y>`.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import pstats
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vs_trl import verst_overrides  # benchmarks/ is this script's folder, so on sys.path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "reverse_digits"


class PhaseClock:
    """Wall and CPU seconds per named phase, summed within each step."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.steps: list[tuple[dict[str, float], dict[str, float]]] = []
        self.profiler: cProfile.Profile | None = None
        self.profiling = False

    def wrap(self, name: str, fn: Callable[..., Any], *, profile: bool = False) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            on = profile and self.profiling and self.profiler is not None
            if on:
                self.profiler.enable()  # type: ignore[union-attr]
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[name] += time.perf_counter() - w
                self.cpu[name] += time.process_time() - c
                if on:
                    self.profiler.disable()  # type: ignore[union-attr]

        return timed

    def end_step(self, step_s: float) -> None:
        wall, cpu = dict(self.wall), dict(self.cpu)
        wall["step"] = step_s
        self.steps.append((wall, cpu))
        self.wall.clear()
        self.cpu.clear()


def _patch(obj: Any, attr: str, clock: PhaseClock, name: str, *, profile: bool = False) -> None:
    fn = getattr(obj, attr, None)
    if fn is not None:
        setattr(obj, attr, clock.wrap(name, fn, profile=profile))


def instrument(trainer: Any, clock: PhaseClock) -> None:
    """Wrap the step's pieces (instance attributes and module globals) with `clock`'s timers."""
    from verst.trainer.run import controller
    from verst.trainer.train import side

    train, sync = trainer.train, trainer.sync
    _patch(trainer, "_shared_rollout", clock, "rollout")
    _patch(trainer, "_train_and_record", clock, "train+record", profile=True)
    _patch(controller, "build_train_batch", clock, "build_batch")
    _patch(controller, "keyed_detail", clock, "keyed_detail")
    if trainer.recorder is not None:
        _patch(trainer.recorder, "choose", clock, "record.choose")
        _patch(trainer.recorder, "record_rollout", clock, "record.write")
        _patch(trainer.recorder, "phase", clock, "status_writes")
    _patch(train, "train_step", clock, "train_step")
    _patch(train, "_plan", clock, "ts.plan")
    _patch(train, "_step_tensors", clock, "ts.advantages")
    _patch(train, "_policy_updates", clock, "ts.updates")
    _patch(train, "_forward_for_loss", clock, "ts.forward")
    _patch(train, "_lay_out", clock, "ts.forward.layout")
    _patch(train, "_optimizer_step", clock, "ts.optimizer_step")
    _patch(side, "backward", clock, "ts.backward")
    _patch(side, "StepDetailCollector", clock, "ts.detail_collector")
    _patch(train, "step_detail", clock, "step_detail")
    _patch(sync, "push", clock, "sync", profile=True)
    _patch(train, "state_dict_for_sync", clock, "sync.state_dict")
    if sync.planner is not None:
        _patch(sync.planner, "plan", clock, "sync.plan")
        _patch(sync.planner, "done", clock, "sync.done")
    if sync.transport is not None:
        _patch(sync.transport, "push", clock, "sync.transport")


class StepLogger:
    """An in-memory metrics logger that closes each step of the clock."""

    def __init__(self, clock: PhaseClock) -> None:
        self.clock = clock
        self.records: list[tuple[int, dict[str, float]]] = []

    def log(self, step: int, metrics: Any) -> None:
        self.records.append((step, dict(metrics)))
        if "time/step_s" in metrics:
            self.clock.end_step(metrics["time/step_s"])

    def phase(self, name: str) -> None:
        pass

    def close(self) -> None:
        pass


def run(steps: int, warmup: int, threads: int, seed: int, profile_top: int) -> dict[str, Any]:
    from verst.rollout.selection import resolve_extra_env_vars
    from verst.trainer.cli import add_config_dir_to_path, resolve_paths
    from verst.trainer.config import load_run_config
    from verst.trainer.run.controller import Trainer

    clock = PhaseClock()
    if profile_top:
        clock.profiler = cProfile.Profile()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = resolve_paths(
            load_run_config(EXAMPLE / "config.toml", verst_overrides(tmp, steps, threads, seed)),
            EXAMPLE / "config.toml",
        )
        add_config_dir_to_path(EXAMPLE / "config.toml")
        trainer = Trainer(cfg, tmp, env=resolve_extra_env_vars(cfg.run.env), logger=StepLogger(clock))
        try:
            instrument(trainer, clock)
            original_step = trainer._step

            def step(i: int, summary: Any) -> bool:
                clock.profiling = i >= warmup
                cpu = time.process_time()
                try:
                    return original_step(i, summary)
                finally:  # the whole step's CPU time (all threads), closing the logged step
                    clock.steps[-1][1]["step"] = time.process_time() - cpu

            trainer._step = step
            trainer.run()
        finally:
            trainer.close()
    kept = clock.steps[warmup:]
    names = sorted({k for wall, _ in kept for k in wall})
    out: dict[str, Any] = {"steps": len(kept), "threads": threads}
    for k in names:
        out[k] = {
            "wall_ms": round(1e3 * statistics.median(w.get(k, 0.0) for w, _ in kept), 3),
            "cpu_ms": round(1e3 * statistics.median(c.get(k, 0.0) for _, c in kept), 3),
        }
    if clock.profiler is not None:
        buf = io.StringIO()
        pstats.Stats(clock.profiler, stream=buf).sort_stats("tottime").print_stats(profile_top)
        print(buf.getvalue())
        buf = io.StringIO()
        pstats.Stats(clock.profiler, stream=buf).sort_stats("cumulative").print_stats(profile_top)
        print(buf.getvalue())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (train and engine)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=int, default=0, help="print the top N cProfile entries")
    args = parser.parse_args()
    out = run(args.steps, args.warmup, args.threads, args.seed, args.profile)
    width = max(map(len, out))
    for k, v in out.items():
        if isinstance(v, dict):
            print(f"{k:<{width}}  wall {v['wall_ms']:8.2f} ms  cpu {v['cpu_ms']:8.2f} ms")
    print(json.dumps(out))
    step = out.get("step", {})
    print(
        f"step_wall_ms={step.get('wall_ms', float('nan')):.2f} step_cpu_ms={step.get('cpu_ms', float('nan')):.2f}"
    )


if __name__ == "__main__":
    main()
