#!/usr/bin/env python3
"""The GPU check: what only a GPU shows, in one command, on a lent GPU machine as it comes.

Why: the default test suite runs on CPU (Triton under TRITON_INTERPRET, `verst serve` standing
in for SGLang). The GPU machines this project is lent (one H200) reach no package registry and
have no uv; their `python3` holds torch, triton, transformers, accelerate and peft. So this
script installs nothing: it runs on that `python3` and imports verst from the packages' `src`
folders (`scripts/gpu_check.sh` sets PYTHONPATH; run directly, this file sets it for its
children). It writes nothing outside OUT and a temporary folder it removes.

Stages, each in a child process with its own time budget (seconds), the whole run <= 8 minutes:
  env      (60)  versions; every verst module imports from PYTHONPATH with no installed dist
                 metadata; the CUDA device; a tiny random model saved locally (no download)
  kernels  (150) compiled Triton kernels vs float64 at T=32,768 x V=151,936 bf16 (past 2^31
                 elements), their time vs the measured copy bandwidth, a [B,T+1,V][:, :-1]
                 slice read in place, the OPD backward with 16 target ids (registers, spills)
  engine   (60)  the embedded engine's grouped-query attention vs SDPA on CUDA (fp32, bf16)
  fsdp     (90)  FSDP2 on one GPU through verst's trainer: fp32 master parameters and AdamW
                 state, bf16 compute, one train step
  grpo     (150) 3-step GRPO runs on CUDA with the embedded engine (fp32, bf16), their
                 train/rollout log-prob mismatch
  sglang   (240) a real SGLang 0.5.23 server and router with the client (SKIP where sglang is
                 not installed, as on the lent image; `--cuda-graph-max-bs-decode` for 0.5.23)
A stage whose needs are missing (no CUDA device, a module verst needs that this python3 lacks)
is not started: its checks SKIP with the reason.

Every check prints exactly one line, `PASS|FAIL|SKIP name: detail`, in stage order; a stage that
crashes or runs past its budget gives FAIL lines for the checks it did not report. OUT is
`--out`, else `$OUT`, else `gpu-check-out`; at most 6 files go there: summary.txt (the lines
and a total), results.jsonl (one JSON object per check, then the facts), gpu_check.log (the
stages' own output). Exit status 1 on any FAIL.

Usage: python3 scripts/gpu_check.py [--out DIR] [--only kernels,engine,...] [--budget-s 480]
                                    [--budget-scale 1] [--sglang-server sglang|verst]
                                    [--extra-path DIR]
  --only           run only these stages (env always runs); the others' checks SKIP
  --budget-s       the whole run's budget (default 480: 8 minutes)
  --budget-scale   multiply every budget (a CPU rehearsal on a loaded machine)
  --sglang-server  verst: run the sglang stage against `verst serve` on CPU (a rehearsal)
  --extra-path     a folder put first on the children's PYTHONPATH (e.g. pure-Python packages
                   verst needs that this python3 lacks, unpacked on another machine)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC_DIRS = [str(p) for p in sorted((REPO / "packages").glob("*/src"))]
"""The packages' `src` folders: verst's import path without installing anything."""
TOTAL_BUDGET_S = 480.0
MIN_STAGE_S = 15.0
"""A stage is not started with less of the whole budget left than this."""


@dataclass(frozen=True)
class Stage:
    """A group of checks run in one child process."""

    name: str
    budget_s: float
    checks: tuple[str, ...]
    needs_cuda: bool = True
    needs_sglang: bool = False
    imports: tuple[str, ...] = ()
    """verst modules the stage imports (a missing third-party module skips it, named)."""


STAGES = (
    Stage(
        "env",
        60,
        ("env/versions", "env/imports_from_pythonpath", "env/cuda_device", "env/tiny_model"),
        needs_cuda=False,
    ),
    Stage(
        "kernels",
        150,
        (
            "kernels/copy_bandwidth",
            "kernels/token_logprobs_T32768_V151936_bf16",
            "kernels/shifted_slice_read_in_place",
            "kernels/opd_backward_M16",
        ),
        imports=("verst.kernels",),
    ),
    Stage(
        "engine",
        60,
        ("engine/grouped_attention_float32", "engine/grouped_attention_bfloat16"),
        imports=("verst.rollout.engines.embedded.attention",),
    ),
    Stage("fsdp", 90, ("fsdp/fp32_masters_bf16_compute_one_gpu",), imports=("verst.trainer.train.side",)),
    Stage(
        "grpo",
        150,
        ("grpo/embedded_3_steps_float32", "grpo/embedded_3_steps_bfloat16"),
        imports=("verst.trainer.run.controller", "verst.rollout.engines.embedded.engine"),
    ),
    Stage(
        "sglang",
        240,
        (
            "sglang/launch",
            "sglang/launch_deterministic",
            "sglang/fresh_version_reads_0",
            "sglang/client_suite",
            "sglang/logprobs_vs_hf",
            "sglang/exact_abort",
            "sglang/refit_disk",
            "sglang/refit_tensor_buckets",
            "sglang/refit_distributed_gloo_buckets",
            "sglang/nccl_refused_on_shared_gpu",
            "sglang/release_resume_keeps_weights",
            "sglang/colocated_order_release_refit_resume",
            "sglang/sampling_seed_with_deterministic_inference",
            "router/launch_and_workers",
            "router/generate_abort_refit",
        ),
        needs_sglang=True,
        imports=("verst.rollout.engines.sglang.client", "verst.trainer.sync.weight_sync"),
    ),
)
SGLANG_MISSING = (
    "sglang is not installed in this python3 (the lent image has none, and its ~4.4 GiB of "
    "wheels cannot be carried); on a box with a registry: `uv sync --extra sglang`"
)


@dataclass
class Run:
    """The driver's state: where things go, what the env stage found, what was printed."""

    out: Path
    work: Path
    env: dict[str, str]
    deadline: float
    budget_scale: float = 1.0
    facts: dict = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: {"PASS": 0, "FAIL": 0, "SKIP": 0})

    def report(self, status: str, name: str, detail: str, seconds: float | None = None) -> None:
        """Print one check's line and append it to summary.txt and results.jsonl."""
        text = f"{status} {name}: {detail}".replace("\n", " ")[:700]
        print(text, flush=True)
        self.counts[status] += 1
        with (self.out / "summary.txt").open("a") as fh:
            fh.write(text + "\n")
        record = {"check": name, "status": status, "detail": detail, "seconds": seconds}
        with (self.out / "results.jsonl").open("a") as fh:
            fh.write(json.dumps(record) + "\n")


def skip_reason(stage: Stage, facts: dict) -> str | None:
    """Why `stage` cannot run here (None: it can)."""
    if stage.needs_cuda and not facts.get("cuda"):
        return facts.get("cuda_reason") or "no CUDA device visible to torch"
    if stage.needs_sglang and not facts.get("sglang"):
        return SGLANG_MISSING
    missing = {m: facts.get("import_errors", {}).get(m) for m in stage.imports}
    missing = {m: why for m, why in missing.items() if why}
    if missing:
        return "; ".join(f"{m} does not import here: {why}" for m, why in missing.items())
    return None


def run_stage(run: Run, stage: Stage, extra: list[str]) -> None:
    """Run one stage's child within its budget; report every check it did not report as FAIL."""
    left = run.deadline - time.monotonic()
    budget = min(stage.budget_s * run.budget_scale, left)
    results = run.work / f"{stage.name}.jsonl"
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "gpu_checks.py"), stage.name]
    cmd += ["--results", str(results), "--work", str(run.work), *extra]
    start = time.monotonic()
    with (run.out / "gpu_check.log").open("a") as log:
        log.write(f"\n===== stage {stage.name} (budget {budget:.0f} s): {' '.join(cmd)}\n")
        log.flush()
        child = subprocess.Popen(
            cmd, env=run.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc: int | str = child.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # its servers too: they share its session
            child.wait()
            rc = "timeout"
    took = time.monotonic() - start
    got = {}
    if results.exists():
        for line in results.read_text().splitlines():
            record = json.loads(line)
            if "facts" in record:
                run.facts.update(record["facts"])
            else:
                got[record["check"]] = record
    for name in stage.checks:
        if name in got:
            r = got[name]
            run.report(r["status"], name, r["detail"], r.get("seconds"))
        elif rc == "timeout":
            run.report(
                "FAIL", name, f"stage {stage.name} ran past its {budget:.0f} s budget before this check ended"
            )
        else:
            run.report(
                "FAIL",
                name,
                f"stage {stage.name} ended (exit {rc}, {took:.0f} s) without this check's result; see gpu_check.log",
            )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", default=None, help="where the <= 6 result files go (default: $OUT, else gpu-check-out)"
    )
    p.add_argument("--only", default=None, help="comma-separated stages to run (env always runs)")
    p.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S, help="the whole run's budget")
    p.add_argument(
        "--budget-scale",
        type=float,
        default=1.0,
        help="multiply every stage's budget (a loaded CPU rehearsal)",
    )
    p.add_argument("--sglang-server", default="sglang", choices=["sglang", "verst"])
    p.add_argument("--extra-path", default=None, help="a folder put first on the children's PYTHONPATH")
    args = p.parse_args(argv)
    names = [s.name for s in STAGES]
    wanted = names if args.only is None else [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = [x for x in wanted if x not in names]
    if unknown:
        p.error(f"--only: unknown stage(s) {unknown}; the stages are {', '.join(names)}")
    args.wanted = {"env", *wanted}
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out or os.environ.get("OUT") or "gpu-check-out").resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name in ("summary.txt", "results.jsonl", "gpu_check.log"):
        (out / name).unlink(missing_ok=True)
    paths = ([args.extra_path] if args.extra_path else []) + SRC_DIRS
    old = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths + ([old] if old else []))}
    env.pop("TRITON_INTERPRET", None)  # the compiled kernels are what is checked
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="verst-gpu-check-") as work:
        run = Run(out, Path(work), env, started + args.budget_s * args.budget_scale, args.budget_scale)
        print(
            f"gpu_check: out={out} python={sys.executable} stages={','.join(sorted(args.wanted))}", flush=True
        )
        extra = ["--sglang-server", args.sglang_server]
        for stage in STAGES:
            reason = None if stage.name in args.wanted else "not selected (--only)"
            reason = reason or skip_reason(stage, run.facts)
            if reason is None and run.deadline - time.monotonic() < MIN_STAGE_S:
                reason = f"the run's {args.budget_s:.0f} s budget is spent"
            if reason is not None:
                for name in stage.checks:
                    run.report("SKIP", name, reason)
                continue
            run_stage(run, stage, extra)
        with (out / "results.jsonl").open("a") as fh:
            fh.write(json.dumps({"facts": run.facts}) + "\n")
    c = run.counts
    total = f"gpu_check: {c['PASS']} passed, {c['FAIL']} failed, {c['SKIP']} skipped in {time.monotonic() - started:.0f} s"
    print(total, flush=True)
    with (out / "summary.txt").open("a") as fh:
        fh.write(total + "\n")
    return 1 if c["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
