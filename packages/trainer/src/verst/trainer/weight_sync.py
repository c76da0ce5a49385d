"""Push the trained weights to the engines after every step; the weight version rises by one.

Modes (`train.weight_sync`):
- `tensors`: in-process, no disk — the embedded engine copies the full state dict
  (`update_weights_from_tensors`). The default when the engine lives in this process.
- `disk`: the train side writes a Hugging Face checkpoint under `<run>/weights/v<N>/` and the
  engine (an SGLang server, a router, or `verst serve`, through the client's
  pause → flush → update → continue sequence) loads it (`update_weights_from_disk`). The default
  for out-of-process engines. The previous version's folder is deleted once the new one loads.

The engine must report exactly the version it was asked for; anything else is an error (a
silent mismatch would train on samples labelled with the wrong policy).

Under FSDP gathering the full weights is a collective: every rank calls `push`, only rank 0
talks to the engine, and the new version is broadcast back.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Literal, Protocol

from verst.trainer.fsdp import DistInfo, broadcast_object

SyncMode = Literal["auto", "tensors", "disk"]


class WeightSyncError(RuntimeError):
    """The engine did not end up on the weight version the trainer pushed."""


class _TrainSurface(Protocol):
    def state_dict_for_sync(self) -> dict: ...
    def save_hf(self, path: str | Path, state_dict: dict | None = None) -> None: ...


class _RolloutSurface(Protocol):
    in_process_engine: bool

    def update_weights_from_tensors(self, named_tensors: dict, weight_version: int) -> int: ...
    def update_weights_from_disk(self, path: str, weight_version: int) -> int: ...


class WeightSync:
    """Moves weights from the train side to the rollout side, version-checked."""

    def __init__(
        self,
        train: _TrainSurface,
        rollout: _RolloutSurface | None,
        *,
        mode: SyncMode,
        staging_dir: str | Path,
        dist_info: DistInfo,
        weight_version: int = 0,
    ) -> None:
        """`rollout` is None on ranks other than 0 (they only join the gather)."""
        self.train = train
        self.rollout = rollout
        self.staging_dir = Path(staging_dir)
        self.dist = dist_info
        self.weight_version = weight_version
        """The version the engines hold."""
        if mode == "auto":
            in_process = broadcast_object(
                rollout.in_process_engine if rollout is not None else None, dist_info
            )
            mode = "tensors" if in_process else "disk"
        self.mode: SyncMode = mode
        """The resolved mode: tensors or disk."""
        self._last_dir: Path | None = None

    def push(self, version: int | None = None) -> int:
        """Send the current weights as `version` (default: current + 1); returns the new version."""
        target = self.weight_version + 1 if version is None else version
        state = self.train.state_dict_for_sync()  # collective under FSDP
        got = None
        if self.dist.is_main and self.rollout is not None:
            if self.mode == "tensors":
                got = self.rollout.update_weights_from_tensors(state, target)
            else:
                path = self.staging_dir / f"v{target}"
                if path.exists():
                    shutil.rmtree(path)
                self.train.save_hf(path, state)
                got = self.rollout.update_weights_from_disk(str(path), target)
                if self._last_dir is not None and self._last_dir != path:
                    shutil.rmtree(self._last_dir, ignore_errors=True)
                self._last_dir = path
            if got != target:
                raise WeightSyncError(
                    f"weight sync ({self.mode}): asked the engine for version {target}, it reports {got}; "
                    "the engine may have been updated by someone else or failed to load the weights"
                )
        self.weight_version = int(broadcast_object(got, self.dist) if self.dist.distributed else target)
        return self.weight_version
