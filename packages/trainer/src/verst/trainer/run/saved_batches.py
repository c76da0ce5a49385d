"""The training batch of each step, saved for `verst replay` (`run.save_rollouts = true`).

`rollouts/step_N.pt` holds what train step N (the one that produces checkpoint N) consumed: the
`TrainBatch` exactly as built after the rollout side (tokens, masks, rollout log-probs, rewards,
sample keys, ...) and the RNG states (`capture_rng`) taken right before the train step, so a
replay draws the same random numbers even though the rollout in between consumed some.
Only the newest `keep` files stay (like `run.keep_checkpoints`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from verst.trainer.run.checkpoint import capture_rng
from verst.trainer.train.batch import TrainBatch

FOLDER = "rollouts"
_NAME = re.compile(r"^step_(\d+)\.pt$")


def batch_path(run_dir: str | Path, step: int) -> Path:
    """Where the batch of train step `step` (1-based: the step that writes checkpoint `step`) lives."""
    return Path(run_dir) / FOLDER / f"step_{step}.pt"


def save_batch(run_dir: str | Path, step: int, batch: TrainBatch, *, keep: int | None) -> Path:
    """Write `batch` and the current RNG states atomically (temp file, then rename); prune to `keep`."""
    path = batch_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".pt.tmp")
    torch.save({"step": step, "batch": batch, "rng": capture_rng()}, tmp)
    os.replace(tmp, path)
    if keep is not None:
        found = sorted(
            (int(m.group(1)), child) for child in path.parent.iterdir() if (m := _NAME.match(child.name))
        )
        for _step, old in found[: max(0, len(found) - keep)]:
            old.unlink(missing_ok=True)
    return path


def load_batch(path: str | Path) -> tuple[TrainBatch, dict[str, Any]]:
    """(batch, RNG states) of a file written by `save_batch` (a trusted local file: pickled)."""
    saved = torch.load(path, weights_only=False)
    return saved["batch"], saved["rng"]
