"""Atomic checkpoints: written aside as `step_N.tmp/`, fsynced, then renamed to `step_N/`.

A rename within one directory is atomic on POSIX file systems, so a crash at any moment leaves
either the previous complete checkpoint or the new one — never a half-written `step_N/`.
`latest_checkpoint` ignores `*.tmp` folders and any folder without its `meta.json` (written last,
inside the temp folder, before the rename).

What goes in (the controller composes it): the train side's model / optimizer / scheduler
(`TrainSide.save`), the rollout side's data source and strategy state (buffered samples
included), RNG states (python, numpy, torch), the step, rollout id and weight version.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

_STEP_DIR = re.compile(r"^step_(\d+)$")
META = "meta.json"


def _fsync_tree(path: Path) -> None:
    """fsync every file under `path` and the folders themselves."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(Path(root))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    root: str | Path,
    step: int,
    write: Callable[[Path], None],
    meta: dict[str, Any],
    *,
    keep: int | None = None,
) -> Path:
    """Write a checkpoint for `step` atomically; `write(tmp_dir)` fills it. Returns the final path."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f"step_{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    write(tmp)
    (tmp / META).write_text(json.dumps({"step": step, **meta}, indent=2, default=str))
    _fsync_tree(tmp)
    if final.exists():  # re-saving the same step (e.g. end of run right after a periodic save)
        old = root / f"step_{step}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    if keep is not None:
        prune_checkpoints(root, keep)
    return final


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (name `step_N` with a `meta.json`), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir() and (child / META).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def read_meta(path: str | Path) -> dict[str, Any]:
    """The `meta.json` of a checkpoint."""
    return json.loads((Path(path) / META).read_text())


def prune_checkpoints(root: str | Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints, and stale temp folders."""
    found = list_checkpoints(root)
    for _step, path in found[: max(0, len(found) - keep)]:
        shutil.rmtree(path, ignore_errors=True)
    for stale in Path(root).glob("step_*.tmp"):  # left by a crash; this process writes one at a time
        shutil.rmtree(stale, ignore_errors=True)


def capture_rng() -> dict[str, Any]:
    """Python, numpy and torch (CPU and CUDA) RNG states."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
