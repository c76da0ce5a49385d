"""Push the trained weights to the engines after every step; the weight version rises by one.

Modes (`train.weight_sync`):
- `tensors`: in-process, no disk — the embedded engine copies the full state dict
  (`update_weights_from_tensors`). The default when the engine lives in this process.
- `disk`: the train side writes a Hugging Face checkpoint under `<run>/weights/v<N>/` and the
  engine (an SGLang server, a router, or `verst serve`, through the client's
  pause → flush → update → continue sequence) loads it (`update_weights_from_disk`). The default
  for out-of-process engines. The previous version's folder is deleted once the new one loads.

- `distributed`: the trainer is rank 0 of a dedicated weight-update group built with the same
  torch helper SGLang uses (`verst.rollout.engines.weight_group`; never torch.distributed's
  default group, so FSDP's is untouched). Every engine worker joins once
  (`init_weights_update_group`): an engine with G GPUs takes G ranks from its own rank offset,
  so `world_size = 1 + Σ G`. Each push runs inside one SGLang weight-update session (pause →
  flush → begin → buckets → end → continue); per bucket of at most `bucket_bytes` the trainer
  starts `update_weights_from_distributed` (flush only with the last) and broadcasts the bucket's
  tensors in order. gloo on CPU (tested against `verst serve`), NCCL on CUDA (needs one GPU per
  rank: refused when trainer and engine share a GPU — use disk or tensor refit there). HTTP
  engines only (`verst serve`, SGLang servers, routers, several of them).

The engine must report exactly the version it was asked for; anything else is an error (a
silent mismatch would train on samples labelled with the wrong policy).

Under FSDP gathering the full weights is a collective: every rank calls `push`, only rank 0
talks to the engine, and the new version is broadcast back.
"""

from __future__ import annotations

import shutil
import socket
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

from verst.rollout.engine import DistributedWeightReceiver, EngineCapabilities
from verst.trainer.fsdp import DistInfo, broadcast_object

SyncMode = Literal["auto", "tensors", "disk", "distributed"]


class WeightSyncError(RuntimeError):
    """The engine did not end up on the weight version the trainer pushed."""


class _TrainSurface(Protocol):
    def state_dict_for_sync(self) -> dict: ...
    def save_hf(self, path: str | Path, state_dict: dict | None = None) -> None: ...


class _RolloutSurface(Protocol):
    engine_capabilities: EngineCapabilities
    engine: Any

    def submit(self, coro: Any) -> Any: ...

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
        master_address: str = "127.0.0.1",
        backend: str | None = None,
        group_timeout_s: float = 120.0,
        bucket_bytes: int = 512 << 20,
        shares_gpu_with_engine: bool = False,
    ) -> None:
        """`rollout` is None on ranks other than 0 (they only join the gather).

        For `distributed`: `master_address` is this host's address as the engine sees it (the
        group's store listens on a free port there); `backend` defaults to nccl with CUDA, else gloo.
        """
        self.train = train
        self.rollout = rollout
        self.staging_dir = Path(staging_dir)
        self.dist = dist_info
        self.weight_version = weight_version
        """The version the engines hold."""
        caps = rollout.engine_capabilities if rollout is not None else None
        if mode == "auto":  # the engine's preferred mode
            mode = broadcast_object(caps.weight_sync[0] if caps is not None else None, dist_info)
        if caps is not None and mode not in caps.weight_sync:
            from verst.rollout.errors import ConfigError, Problem

            where = "it lives in this process" if caps.in_process else "it does not accept it"
            raise ConfigError(
                [
                    Problem(
                        "train.weight_sync",
                        f"the engine cannot receive weights by {mode!r}: {where} (it accepts "
                        f"{', '.join(caps.weight_sync)})",
                        f"use train.weight_sync={caps.weight_sync[0]!r} (or 'auto'), or serve the "
                        "model with `verst serve` / SGLang and set engine.type='sglang'",
                    )
                ]
            )
        self.mode: SyncMode = mode
        """The resolved mode: tensors, disk or distributed."""
        self.master_address = master_address
        """distributed: the address the engine reaches this process on."""
        self.backend = backend
        """distributed: gloo or nccl (None = nccl with CUDA, else gloo)."""
        self.group_timeout_s = group_timeout_s
        """distributed: seconds to wait for the group's rendezvous and each broadcast."""
        self.bucket_bytes = bucket_bytes
        """distributed: at most this many tensor bytes per update call."""
        self.shares_gpu_with_engine = shares_gpu_with_engine
        """distributed: the trainer's GPU also holds an engine (colocated) — NCCL is refused."""
        self.group: Any = None
        """distributed: this process's member (rank 0) of the weight-update group, once joined."""
        self._last_dir: Path | None = None
        self.last_bytes: int | None = 0
        """Bytes of the tensors the last push moved (the adapter's only with LoRA; rank 0's count;
        None when not known here)."""

    def push(self, version: int | None = None) -> int:
        """Send the current weights as `version` (default: current + 1); returns the new version.

        With `[train.lora]` only the adapter moves (`verst.trainer.lora_sync.push_adapter`)."""
        target = self.weight_version + 1 if version is None else version
        if getattr(self.train, "lora", None) is not None:
            from verst.trainer.lora_sync import push_adapter

            got = push_adapter(self, target)
            return self._settle(got, target)
        state = self.train.state_dict_for_sync()  # collective under FSDP
        self.last_bytes = (
            sum(t.numel() * t.element_size() for t in state.values())
            if isinstance(state, Mapping)
            else getattr(state, "nbytes", None)  # Ray: the weights stay in the object store
        )
        got = None
        if self.dist.is_main and self.rollout is not None:
            if self.mode == "tensors":
                got = self.rollout.update_weights_from_tensors(state, target)
            elif self.mode == "distributed":
                got = self._push_distributed(state, target)
            else:
                path = self.staging_dir / f"v{target}"
                if path.exists():
                    shutil.rmtree(path)
                self.train.save_hf(path, state)
                got = self.rollout.update_weights_from_disk(str(path), target)
                if self._last_dir is not None and self._last_dir != path:
                    shutil.rmtree(self._last_dir, ignore_errors=True)
                self._last_dir = path
        return self._settle(got, target)

    def _settle(self, got: int | None, target: int) -> int:
        """Check the engine's reported version (rank 0) and share it with every rank."""
        if self.dist.is_main and self.rollout is not None and got != target:
            raise WeightSyncError(
                f"weight sync ({self.mode}): asked the engine for version {target}, it reports {got}; "
                "the engine may have been updated by someone else or failed to load the weights"
            )
        self.weight_version = int(broadcast_object(got, self.dist) if self.dist.distributed else target)
        return self.weight_version

    # ---- distributed -------------------------------------------------------------------------
    def _engines(self) -> list[DistributedWeightReceiver]:
        """The engine, or each engine of a pool: every one gets its own rank offset."""
        assert self.rollout is not None
        engine = self.rollout.engine
        engines = list(getattr(engine, "engines", None) or [engine])
        bad = [e for e in engines if not isinstance(e, DistributedWeightReceiver)]
        if bad:
            raise WeightSyncError(
                f"weight_sync='distributed': {bad[0]!r} cannot receive weights by broadcast; "
                "use train.weight_sync='disk' or 'tensors'"
            )
        return engines

    def _ensure_group(self) -> Any:
        """Join the weight-update group as rank 0 while every engine worker joins with its offset."""
        if self.group is not None:
            return self.group
        import torch

        from verst.rollout.engines.weight_group import engine_rank_offsets, join_weight_group

        assert self.rollout is not None
        backend = self.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl" and self.shares_gpu_with_engine:
            raise WeightSyncError(
                "weight_sync='distributed' over NCCL needs the trainer and each engine on different "
                "GPUs (NCCL rejects two ranks on one device), but this run colocates them; use "
                "train.weight_sync='disk' or 'tensors' when colocated, or a disaggregated layout"
            )
        engines = self._engines()
        ranks = [self.rollout.submit(e.weight_group_ranks()).result(self.group_timeout_s) for e in engines]
        offsets, world_size = engine_rank_offsets(ranks)
        port = _free_port(self.master_address)
        name = f"verst-refit-{uuid.uuid4().hex[:8]}"
        calls = [
            self.rollout.submit(
                e.init_weights_update_group(self.master_address, port, off, world_size, name, backend=backend)
            )
            for e, off in zip(engines, offsets, strict=True)
        ]
        try:
            group = join_weight_group(
                self.master_address, port, 0, world_size, name, backend, timeout_s=self.group_timeout_s
            )
            for call in calls:
                call.result(timeout=self.group_timeout_s)  # each engine's answer (raises its error)
        except BaseException:
            for call in calls:
                call.cancel()
            raise
        self.group = group
        return group

    def _push_distributed(self, state: dict, target: int) -> int:
        from verst.rollout.engines.weight_group import buckets, dtype_name

        group = self._ensure_group()
        assert self.rollout is not None
        engines = self._engines()
        submit = self.rollout.submit
        wait = self.group_timeout_s
        for call in [submit(e.begin_weight_update()) for e in engines]:
            call.result(wait)
        ok = False
        try:
            parts = list(
                buckets(((n, t.numel() * t.element_size()) for n, t in state.items()), self.bucket_bytes)
            )
            for i, names in enumerate(parts):
                last = i == len(parts) - 1
                calls = [
                    submit(
                        e.update_weights_from_distributed_bucket(
                            names,
                            [dtype_name(state[n].dtype) for n in names],
                            [list(state[n].shape) for n in names],
                            group.name,
                            weight_version=target if last else None,
                            flush_cache=last,
                        )
                    )
                    for e in engines
                ]
                try:
                    for n in names:
                        group.broadcast(state[n].detach().to(group.device).contiguous(), src=0)
                except BaseException as exc:
                    for call in calls:
                        call.cancel()
                    hint = _nccl_hint(exc)
                    if hint is exc:
                        raise
                    raise hint from exc
                for call in calls:
                    call.result(wait)
            ok = True
        finally:
            for call in [submit(e.end_weight_update(target, check=ok)) for e in engines]:
                call.result(wait)
        versions = {self.rollout.submit(e.get_weight_version()).result(wait) for e in engines}
        return int(versions.pop()) if len(versions) == 1 else -1

    def close(self) -> None:
        """Leave the weight-update group (distributed mode); safe to call more than once."""
        if self.group is not None:
            self.group.close()
            self.group = None


def _nccl_hint(exc: BaseException) -> BaseException:
    """Name the usual cause when NCCL refuses a group with two ranks on one GPU."""
    text = str(exc)
    if "Duplicate GPU" in text or "duplicate GPU" in text:
        return WeightSyncError(
            f"NCCL refused the weight-update group: {text.strip()[:300]}. The trainer and an engine "
            "share a GPU; use train.weight_sync='disk' or 'tensors' there, or put them on different GPUs"
        )
    return exc


def _free_port(host: str) -> int:
    """A port free right now on `host` (for the group's store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
