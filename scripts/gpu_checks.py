"""The stages behind `scripts/gpu_check.py`, one per child process: `python3 gpu_checks.py STAGE
--results FILE --work DIR`. Run through `scripts/gpu_check.py` (or `scripts/gpu_check.sh`); it
sets PYTHONPATH to the packages' `src` folders, budgets each stage and prints the lines.

Each check appends one JSON object `{"check", "status", "detail", "seconds"}` to FILE (the
`env` stage also `{"facts": ...}`: CUDA, sglang, which verst modules import). DIR is the run's
temporary folder (the tiny model is saved there by `env`). The kernels and engine stages are
in `gpu_checks_kernels.py`, the sglang stage in `gpu_checks_sglang.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TESTED = {
    "torch": "2.14.1",
    "triton": "3.8.0",
    "transformers": "5.19.0",
    "accelerate": "1.15.0",
    "peft": "0.21.2",
}
"""The versions verst's lock (and CI) tests with."""


class Recorder:
    """One result per check, appended to the stage's results file (and printed to its log)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.failed = 0
        self.facts: dict[str, Any] = {}
        """What the driver needs to know (the env stage): written by `write_facts`."""

    def line(self, status: str, name: str, detail: str, seconds: float | None = None) -> None:
        print(f"{status} {name}: {detail}", flush=True)
        with self.path.open("a") as fh:
            fh.write(
                json.dumps({"check": name, "status": status, "detail": detail, "seconds": seconds}) + "\n"
            )
        self.failed += status == "FAIL"

    def write_facts(self) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps({"facts": self.facts}) + "\n")

    @contextlib.contextmanager
    def check(self, name: str) -> Iterator[dict[str, Any]]:
        """`with rec.check("x") as info: ...; info["detail"] = "..."`: an exception is a FAIL;
        `info["status"] = "SKIP"` (with the reason as detail) or "FAIL" sets the status."""
        info: dict[str, Any] = {"detail": "ok"}
        start = time.perf_counter()
        try:
            yield info
        except Exception as exc:
            traceback.print_exc()
            self.line("FAIL", name, f"{type(exc).__name__}: {exc}", time.perf_counter() - start)
            return
        took = time.perf_counter() - start
        self.line(info.get("status", "PASS"), name, f"{info['detail']} ({took:.1f}s)", took)


# --------------------------------------------------------------------------------------- env
def _version(module: str) -> str | None:
    """The installed version (from its dist metadata, else its `__version__`), None if absent."""
    import importlib.metadata as md
    import importlib.util

    try:
        return md.version(module)
    except md.PackageNotFoundError:
        pass
    if importlib.util.find_spec(module) is None:
        return None
    return str(getattr(importlib.import_module(module), "__version__", "?"))


def _verst_modules() -> list[str]:
    """Every verst module under packages/*/src (by file, as `test_import_graph` walks them), but
    the `__main__` ones."""
    names = []
    for src in sorted((REPO / "packages").glob("*/src")):
        for f in sorted(src.rglob("*.py")):
            parts = list(f.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__main__":
                continue  # importing it runs the program
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@contextlib.contextmanager
def _no_verst_metadata() -> Iterator[bool]:
    """Make verst's distributions unknown to `importlib.metadata` (as on a machine where verst is
    only on PYTHONPATH); yields whether they were installed here."""
    import importlib.metadata as md

    try:
        md.distribution("verst-trainer")
        installed = True
    except md.PackageNotFoundError:
        installed = False
    real = md.Distribution.from_name.__func__  # type: ignore[attr-defined]

    def from_name(cls: Any, name: str) -> Any:
        if name.lower().replace("_", "-").startswith("verst"):
            raise md.PackageNotFoundError(name)
        return real(cls, name)

    md.Distribution.from_name = classmethod(from_name)  # type: ignore[method-assign,assignment]
    try:
        yield installed
    finally:
        md.Distribution.from_name = classmethod(real)  # type: ignore[method-assign,assignment]


def _import_all(rec: Recorder, stage_imports: list[str]) -> None:
    with rec.check("env/imports_from_pythonpath") as info, _no_verst_metadata() as installed:
        errors: dict[str, str] = {}
        missing: dict[str, int] = {}
        modules = _verst_modules()
        for name in modules:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as exc:
                if (exc.name or "").startswith("verst"):
                    errors[name] = f"{type(exc).__name__}: {exc}"
                else:
                    missing[exc.name or "?"] = missing.get(exc.name or "?", 0) + 1
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"
        outside = sorted({m.__name__ for m in sys.modules.values() if _outside_repo(m)})
        rec.facts["import_errors"] = {m: _import_error(m) for m in stage_imports}
        where = "installed here, hidden for this check" if installed else "none"
        info["detail"] = (
            f"{len(modules)} modules from {len(list((REPO / 'packages').glob('*/src')))} src folders; verst dist metadata: {where}"
        )
        if missing:
            info["detail"] += "; packages this python3 lacks: " + ", ".join(
                f"{k} ({v} modules)" for k, v in sorted(missing.items())
            )
        if outside:
            errors["(path)"] = f"verst modules imported from outside {REPO}: {outside[:5]}"
        if errors or missing:
            info["status"] = "FAIL"
            info["detail"] += "; " + "; ".join(f"{k}: {v}" for k, v in list(errors.items())[:5])


def _outside_repo(module: Any) -> bool:
    name, file = getattr(module, "__name__", ""), getattr(module, "__file__", None)
    return name.startswith("verst.") and file is not None and not Path(file).resolve().is_relative_to(REPO)


def _import_error(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def stage_env(rec: Recorder, work: Path) -> None:
    """Versions, imports from PYTHONPATH, the CUDA device, the tiny model."""
    import importlib.util

    with rec.check("env/versions") as info:
        import platform

        found = {m: _version(m) for m in TESTED}
        rec.facts["versions"] = {"python": platform.python_version(), **found}
        info["detail"] = f"python {platform.python_version()}, " + ", ".join(
            f"{m} {v or 'MISSING'}"
            + ("" if v is None or v.split("+")[0] == TESTED[m] else f" (tested: {TESTED[m]})")
            for m, v in found.items()
        )
        if found["torch"] is None or found["transformers"] is None:
            raise RuntimeError(f"torch and transformers are needed: {info['detail']}")
    from gpu_check import STAGES

    _import_all(rec, sorted({m for s in STAGES for m in s.imports}))
    rec.facts["sglang"] = all(importlib.util.find_spec(m) is not None for m in ("sglang", "sglang_router"))
    with rec.check("env/cuda_device") as info:
        import torch

        rec.facts["cuda"] = torch.cuda.is_available()
        if not rec.facts["cuda"]:
            built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            rec.facts["cuda_reason"] = f"no CUDA device visible to torch {torch.__version__} ({built})"
            info["status"], info["detail"] = "SKIP", rec.facts["cuda_reason"]
        else:
            p = torch.cuda.get_device_properties(0)
            x = torch.randn(1024, 1024, device="cuda")
            assert torch.allclose((x @ x).cpu(), x.cpu() @ x.cpu(), atol=1e-2), "a matmul on the GPU is wrong"
            info["detail"] = (
                f"{torch.cuda.device_count()} x {p.name}, {p.total_memory / 2**30:.0f} GiB, capability "
                f"{p.major}.{p.minor}, CUDA {torch.version.cuda}"
            )
    with rec.check("env/tiny_model") as info:
        path = save_model(work / "model")
        info["detail"] = (
            f"tiny random Llama (hidden 256, 2 layers, bf16) saved to the run's temp folder: {sorted(p.name for p in path.iterdir())}"
        )
    rec.write_facts()


# ------------------------------------------------------------------------------------- model
def save_model(out: str | Path, *, dtype: str = "bfloat16") -> Path:
    """A tiny random Llama (head_dim 64, 2 layers) + char tokenizer, saved locally: no download."""
    import torch

    from verst.rollout.toy import make_tiny_checkpoint

    out = Path(out)
    make_tiny_checkpoint(
        out, seed=0, hidden_size=256, num_layers=2, num_heads=4, max_position_embeddings=8192
    )
    if dtype != "float32":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(out, dtype=getattr(torch, dtype))
        model.save_pretrained(out)
    return out


def scaled_copy(model: Path, out: Path, factor: float) -> Path:
    """`model` with the LM head scaled by `factor` (a different, recognisable policy)."""
    from transformers import AutoModelForCausalLM

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(model, out)
    m = AutoModelForCausalLM.from_pretrained(model)
    m.lm_head.weight.data.mul_(factor)
    m.save_pretrained(out)
    return out


# -------------------------------------------------------------------------------------- fsdp
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stage_fsdp(rec: Recorder, work: Path) -> None:
    """FSDP2 on one GPU through verst's TrainSide, launched like `torchrun --nproc_per_node 1`
    (accelerate turns FSDP on only with LOCAL_RANK set): the parameters are FSDP-managed DTensors
    in float32 (masters) and so is the AdamW state, a decoder layer computes in bfloat16, and one
    train step changes the weights."""
    with rec.check("fsdp/fp32_masters_bf16_compute_one_gpu") as info:
        import torch
        from torch.distributed.tensor import DTensor

        from verst.rollout.toy import toy_groups
        from verst.trainer.algorithms import AlgorithmConfig
        from verst.trainer.config import TrainConfig
        from verst.trainer.train.batch import build_train_batch
        from verst.trainer.train.fsdp import decoder_layers
        from verst.trainer.train.side import TrainSide

        env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
        os.environ.update(env)  # accelerate reads the process environment (as the Ray train actor sets it)
        model = str(work / "model")
        cfg = TrainConfig(model_path=model, fsdp=True, dtype="bfloat16", micro_batch_size=4, lr=1e-3)
        side = TrainSide(
            cfg,
            AlgorithmConfig(),
            model_path=model,
            total_steps=2,
            max_response_len=5,
            temperature=1.0,
            env=env,
        )
        bundle = side.bundle
        params = list(bundle.hf_model.parameters())
        kinds = {(type(p.data if not isinstance(p, DTensor) else p).__name__, p.dtype) for p in params}
        assert bundle.sharding == "fsdp2-accelerate", f"sharding {bundle.sharding!r}"
        assert all(isinstance(p, DTensor) for p in params), (
            f"not FSDP-managed (accelerate left FSDP off): {kinds}"
        )
        assert all(p.dtype == torch.float32 for p in params), f"master parameters are not float32: {kinds}"
        seen: list[Any] = []
        hook = decoder_layers(bundle.hf_model)[0].register_forward_hook(
            lambda _m, _i, out: seen.append((out[0] if isinstance(out, tuple) else out).dtype)
        )
        before = {n: p.full_tensor().detach().clone() for n, p in bundle.hf_model.named_parameters()}
        metrics = side.train_step(build_train_batch(toy_groups(bundle.hf_model.config.vocab_size, seed=3)))
        hook.remove()
        state_dtypes = {
            v.dtype
            for s in bundle.raw_optimizer().state.values()
            for k, v in s.items()
            if k.startswith("exp_avg")
        }
        moved = sum(
            not torch.equal(p.full_tensor(), before[n]) for n, p in bundle.hf_model.named_parameters()
        )
        info["detail"] = (
            f"{len(params)} DTensor float32 parameters, AdamW state {sorted(map(str, state_dtypes))}, decoder "
            f"layer output {sorted(set(map(str, seen)))}, loss {metrics.get('train/loss', float('nan')):.4f}, "
            f"{moved}/{len(params)} parameters changed by one step"
        )
        assert seen and set(seen) == {torch.bfloat16}, "the forward did not compute in bfloat16"
        assert state_dtypes == {torch.float32}, "the AdamW state is not float32"
        assert moved == len(params), "a train step left parameters unchanged"
        side.close()


# -------------------------------------------------------------------------------------- grpo
REWARD = '''
def digit_fraction(sample):
    """Fraction of digit characters in the response (varies across a tiny random model's samples)."""
    return sum(c.isdigit() for c in sample.response) / max(1, len(sample.response))
'''


def _grpo_run(work: Path, dtype: str, device: str = "cuda") -> list[dict[str, float]]:
    from accelerate.state import AcceleratorState

    from verst.trainer.config import run_config_from_dict
    from verst.trainer.run.controller import InMemoryLogger, run_training

    AcceleratorState._reset_state(True)  # each run picks its own mixed precision (one per process otherwise)
    folder = work / f"grpo-{dtype}-{device}"
    shutil.rmtree(folder, ignore_errors=True)  # a fresh run, never a resumed one
    folder.mkdir(parents=True)
    (folder / "gpu_check_reward.py").write_text(REWARD)
    sys.path.insert(0, str(folder))
    data = folder / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+{i + 1}=", "label": str(2 * i + 1)}) + "\n" for i in range(32))
    )
    model = str(work / "model")
    cfg = run_config_from_dict(
        {
            "run": {"num_steps": 3, "seed": 0, "save_interval": 0},
            "engine": {"type": "embedded", "device": device, "dtype": dtype, "max_batch_size": 64},
            "train": {"model_path": model, "dtype": dtype, "lr": 1e-4, "micro_batch_size": 8},
            "rollout": {
                "batch_size": 4,
                "n_samples_per_prompt": 4,
                "max_response_len": 16,
                "seed": 7,
                "data": {"path": str(data), "seed": 3},
                "reward": {"type": "gpu_check_reward:digit_fraction"},
            },
            "algorithm": {"advantage": {"type": "grpo"}},
        }
    )
    logger = InMemoryLogger()
    summary = run_training(cfg, folder / "run", env={}, logger=logger)
    assert summary.steps_done == 3, f"{summary.steps_done} of 3 steps"
    return [m for _, m in logger.records if "train/loss" in m]


def stage_grpo(rec: Recorder, work: Path) -> None:
    """3 GRPO steps on CUDA with the embedded engine: the train/rollout log-prob mismatch (mean |old
    log-prob − rollout log-prob| per token) must be tiny in float32 and small in bfloat16."""
    import math

    for dtype, tol in (("float32", 1e-3), ("bfloat16", 0.1)):
        with rec.check(f"grpo/embedded_3_steps_{dtype}") as info:
            steps = _grpo_run(work, dtype)
            mism = [m.get("train/logprob_mismatch", float("nan")) for m in steps]
            info["detail"] = (
                f"logprob_mismatch per step {[f'{x:.2e}' for x in mism]} (tol {tol}), loss "
                f"{[round(m['train/loss'], 4) for m in steps]}, step s {[round(m['time/step_s'], 2) for m in steps]}"
            )
            assert all(math.isfinite(m["train/loss"]) for m in steps), "a non-finite loss"
            assert all(math.isfinite(x) and x <= tol for x in mism), f"mismatch above {tol}"


# -------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=["env", "kernels", "engine", "fsdp", "grpo", "sglang"])
    p.add_argument("--results", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--sglang-server", default="sglang", choices=["sglang", "verst"])
    args = p.parse_args(argv)
    rec, work = Recorder(args.results), Path(args.work)
    stages: dict[str, Callable[[], None]] = {
        "env": lambda: stage_env(rec, work),
        "kernels": lambda: _kernels(rec, "kernels"),
        "engine": lambda: _kernels(rec, "grouped_attention"),
        "fsdp": lambda: stage_fsdp(rec, work),
        "grpo": lambda: stage_grpo(rec, work),
        "sglang": lambda: _sglang(rec, work, args.sglang_server),
    }
    stages[args.stage]()
    return 1 if rec.failed else 0


def _kernels(rec: Recorder, name: str) -> None:
    import gpu_checks_kernels

    getattr(gpu_checks_kernels, name)(rec)


def _sglang(rec: Recorder, work: Path, server: str) -> None:
    from gpu_checks_sglang import sglang

    logs = work / "sglang-logs"
    logs.mkdir(parents=True, exist_ok=True)
    sglang(work / "model", rec, server, logs)


if __name__ == "__main__":
    sys.exit(main())
