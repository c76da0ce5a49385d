"""`verst replay RUN --step N`: re-run train step N from checkpoint N-1 on the step's saved batch
and check that the result is checkpoint N bit for bit — every weight and every optimizer,
scheduler and counter entry.

It reuses what resume uses (`TrainSide.load`, `restore_rng`) and what the loop uses
(`build_train_side`, `TrainSide.train_step`, `TrainSide.save`), then compares the freshly saved
state with checkpoint N tensor by tensor. The saved batch (`rollouts/step_N.pt`, written with
`run.save_rollouts = true`) carries the RNG states taken right before the original train step,
which replay restores in place of checkpoint N-1's (the rollout in between drew from them).
Single process only (a run trained with FSDP is replayed on one process, which may differ).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from verst.rollout.errors import ConfigError, Problem
from verst.trainer.config import RunConfig, resolved_model_path
from verst.trainer.run.checkpoint import list_checkpoints, restore_rng
from verst.trainer.run.saved_batches import batch_path, load_batch


@dataclass
class TensorDiff:
    """One entry of the state that differs between the replay and checkpoint N."""

    name: str
    """Where: `model/<param>`, `optimizer/state/<i>/exp_avg`, `scheduler/last_epoch`, ..."""
    max_abs_diff: float | None
    """Largest absolute difference (None when shapes, dtypes or kinds differ)."""
    why: str = ""
    """What differs besides values (shape, dtype, missing)."""


@dataclass
class ReplayReport:
    """What a replay found."""

    step: int
    compared: int
    """Entries compared (tensors and plain values)."""
    diffs: list[TensorDiff] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def equal(self) -> bool:
        return not self.diffs

    def lines(self, limit: int = 20) -> list[str]:
        if self.equal:
            return [f"replay of step {self.step}: bit-equal ({self.compared} entries, {self.seconds:.1f}s)"]
        out = [f"replay of step {self.step}: {len(self.diffs)} of {self.compared} entries differ"]
        for d in self.diffs[:limit]:
            what = f"max_abs_diff={d.max_abs_diff:.3g}" if d.max_abs_diff is not None else d.why
            out.append(f"  {d.name}: {what}")
        if len(self.diffs) > limit:
            out.append(f"  ... and {len(self.diffs) - limit} more")
        return out


def _problem(what: str, fix: str) -> ConfigError:
    return ConfigError([Problem("replay", what, fix)])


def _inputs(run_dir: Path, step: int) -> tuple[RunConfig, Path, Path, Path]:
    """(config, checkpoint N-1, checkpoint N, saved batch), or one clear error."""
    resolved = run_dir / "config.resolved.json"
    if not resolved.is_file():
        raise _problem(
            f"{run_dir} is not a run directory (no config.resolved.json)", "pass run.output_dir of a run"
        )
    if step < 1:
        raise _problem(
            f"--step {step}: steps count from 1", "pass --step N with N >= 1 (checkpoint N-1 is its start)"
        )
    config = RunConfig.model_validate_json(resolved.read_text())
    ckpts = dict(list_checkpoints(run_dir / "checkpoints"))
    have = ", ".join(str(s) for s in sorted(ckpts)) or "none"
    for need in (step - 1, step):
        if need not in ckpts and not (need == 0 and step == 1):
            raise _problem(
                f"no checkpoint {need} in {run_dir / 'checkpoints'} (have: {have})",
                "replay needs checkpoints N-1 and N: train with run.save_interval=1 and a large enough "
                "run.keep_checkpoints",
            )
    saved = batch_path(run_dir, step)
    if not saved.is_file():
        raise _problem(
            f"no saved batch for step {step} ({saved})",
            "train with run.save_rollouts=true (the newest run.keep_checkpoints steps are kept)",
        )
    start = ckpts.get(step - 1)  # step 1 starts from the base model when no checkpoint 0 was written
    return config, start, ckpts[step], saved  # type: ignore[return-value]


def replay_step(run_dir: str | Path, step: int, *, env: Mapping[str, str]) -> ReplayReport:
    """Re-run train step `step` of the run in `run_dir` and compare with its checkpoint."""
    import time

    from verst.trainer.run.controller import build_train_side

    t0 = time.perf_counter()
    run_dir = Path(run_dir)
    config, start, target, saved = _inputs(run_dir, step)
    torch.manual_seed(config.run.seed)  # as the run did before building its sides
    train = build_train_side(config, resolved_model_path(config), env)
    try:
        if start is not None:
            train.load(start)  # what resume restores of the train side
        batch, rng = load_batch(saved)
        restore_rng(rng)
        train.train_step(batch)
        with tempfile.TemporaryDirectory(prefix="verst-replay-") as tmp:
            train.save(tmp)
            report = compare_states(_state(Path(tmp)), _state(target), step)
    finally:
        train.close()
    report.seconds = time.perf_counter() - t0
    return report


def _state(path: Path) -> dict[str, Any]:
    """Weights (model/ or adapter/ safetensors) and train_state.pt of a saved train side."""
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for folder in ("model", "adapter", "critic"):
        for f in sorted((path / folder).glob("*.safetensors")):
            out.update({f"{folder}/{k}": v for k, v in load_file(f).items()})
    out.update(_flatten(torch.load(path / "train_state.pt", weights_only=False)))
    return out


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping):
        return {k: v for key, item in value.items() for k, v in _flatten(item, f"{prefix}{key}/").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in _flatten(item, f"{prefix}{i}/").items()}
    return {prefix.rstrip("/"): value}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (so -0.0 differs from 0.0 and a NaN equals the same NaN)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _diffs(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> Iterator[TensorDiff]:
    for name in sorted(set(mine) | set(theirs)):
        if name not in theirs or name not in mine:
            yield TensorDiff(name, None, "only in the replay" if name in mine else "only in the checkpoint")
            continue
        a, b = mine[name], theirs[name]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype:
                yield TensorDiff(name, None, f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
            elif not torch.equal(_bits(a), _bits(b)):
                diff = (a.double() - b.double()).abs()
                yield TensorDiff(name, float(diff.nan_to_num(float("inf")).max()) if diff.numel() else 0.0)
        elif type(a) is not type(b) or a != b:
            yield TensorDiff(name, None, f"{a!r} vs {b!r}")


def compare_states(mine: Mapping[str, Any], theirs: Mapping[str, Any], step: int) -> ReplayReport:
    """Entry-by-entry comparison, bit for bit (tensors byte-equal, other values `==`)."""
    return ReplayReport(step, len(set(mine) | set(theirs)), list(_diffs(mine, theirs)))
