"""Push the trained weights to the engines after every step; the weight version rises by one.

Modes (`train.weight_sync`, one config class each in `verst.trainer.sync.modes`):
- `tensors`: in-process, no disk — the embedded engine copies the full state dict
  (`update_weights_from_tensors`). The default when the engine lives in this process.
- `disk`: the train side writes a Hugging Face checkpoint under `<run>/weights/v<N>/` and the
  engine (an SGLang server, a router, or `verst serve`, through the client's
  pause → flush → update → continue sequence) loads it (`update_weights_from_disk`). The default
  for out-of-process engines. The previous version's folder is deleted once the new one loads.
- `distributed`: the trainer is rank 0 of a dedicated weight-update group that every engine
  worker joins, and broadcasts the weights in byte-bounded buckets inside one weight-update
  session per push (`verst.trainer.sync.distributed`). gloo on CPU, NCCL on CUDA (needs
  one GPU per rank: refused when trainer and engine share a GPU). HTTP engines only.
- `auto`: the engine's preferred mode (the first of its capabilities' `weight_sync`).

`WeightSync` resolves the mode against the live engine's capabilities (the mode's own
`problems` say what the engine rules out), builds the mode's transport, and on each push gathers
the weights and asks the transport to send them. The engine must report exactly the version it
was asked for; anything else is an error (a silent mismatch would train on samples labelled with
the wrong policy).

Under FSDP gathering the full weights is a collective: every rank calls `push`, only rank 0
talks to the engine, and the new version is broadcast back.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from verst.trainer.sync.modes import (
    RolloutSurface,
    ShippedModeConfig,
    SyncContext,
    TrainSurface,
    WeightSyncError,
    WeightSyncSection,
    WeightTransport,
    parse_weight_sync,
)
from verst.trainer.sync.plan import Planner
from verst.trainer.train.fsdp import DistInfo, broadcast_object

__all__ = ["WeightSync", "WeightSyncError"]


class WeightSync:
    """Moves weights from the train side to the rollout side, version-checked."""

    def __init__(
        self,
        train: TrainSurface,
        rollout: RolloutSurface | None,
        *,
        mode: WeightSyncSection | str,
        staging_dir: str | Path,
        dist_info: DistInfo,
        weight_version: int = 0,
        shares_gpu_with_engine: bool = False,
        **mode_options: Any,
    ) -> None:
        """`rollout` is None on ranks other than 0 (they only join the gather). `mode` is a mode
        config or name; `mode_options` are its fields (e.g. distributed's `master_address`,
        `backend`, `bucket_bytes`, `group_timeout_s`). `shares_gpu_with_engine`: a colocated
        layout (distributed refuses NCCL there)."""
        self.train = train
        self.rollout = rollout
        self.dist = dist_info
        self.weight_version = weight_version
        """The version the engines hold."""
        config = parse_weight_sync(_table(mode, mode_options) if mode_options else mode)
        caps = rollout.engine_capabilities if rollout is not None else None
        if caps is not None:
            config = config.resolve(caps)
        self.config: WeightSyncSection = broadcast_object(config, dist_info)
        """The resolved mode's config (rank 0's, on every rank)."""
        problems = self.config.problems("train.weight_sync", caps, "the engine") if caps is not None else []
        if problems:
            from verst.rollout.errors import ConfigError

            raise ConfigError(problems)
        self.staging_dir = Path(staging_dir)
        """Where versions are written (the disk mode's transport, and LoRA adapter pushes)."""
        self._last_dir: Path | None = None
        """LoRA (`verst.trainer.sync.lora.push_adapter`): the adapter folder of the last push."""
        self.last_bytes: int | None = 0
        """Bytes of the tensors the last push moved (the adapter's only with LoRA; rank 0's count;
        None when not known here)."""
        self.last_full = True
        """The last push sent every tensor (False: frozen weights the engines hold stayed home)."""
        self.transport: WeightTransport | None = None
        """The mode's transport, on the rank that talks to the engine (None elsewhere)."""
        self.planner: Planner | None = None
        """What each push leaves out or casts (`verst.trainer.sync.plan`; tensors and disk modes)."""
        if rollout is not None:
            context = SyncContext(train, self.staging_dir, shares_gpu_with_engine=shares_gpu_with_engine)
            self.transport = self.config.build(context)
            if isinstance(self.config, ShippedModeConfig) and caps is not None:
                crosses = not caps.in_process or bool(getattr(train, "remote", False))
                self.planner = self.config.planner(caps, crosses_process=crosses)

    @property
    def mode(self) -> str:
        """The resolved mode's name: tensors, disk, distributed (or an import path)."""
        return self.config.type

    @property
    def group(self) -> Any:
        """distributed: this process's member (rank 0) of the weight-update group, once joined."""
        return getattr(self.transport, "group", None)

    def push(self, version: int | None = None) -> int:
        """Send the current weights as `version` (default: current + 1); returns the new version.

        With `[train.lora]` only the adapter moves (`verst.trainer.sync.lora.push_adapter`)."""
        target = self.weight_version + 1 if version is None else version
        if getattr(self.train, "lora", None) is not None:
            from verst.trainer.sync.lora import push_adapter

            got = push_adapter(self, target)
            return self._settle(got, target)
        plan = self.planner.plan(self.train, self.rollout) if self.planner is not None else None
        state = self.train.state_dict_for_sync(plan) if plan is not None else self.train.state_dict_for_sync()
        self.last_bytes = (
            sum(t.numel() * t.element_size() for t in state.values())
            if isinstance(state, Mapping)
            else getattr(state, "nbytes", None)  # Ray: the weights stay in the object store
        )
        self.last_full = plan is None or plan.full
        got = None
        if self.dist.is_main and self.rollout is not None and self.transport is not None:
            got = self.transport.push(self.rollout, state, target)
        version = self._settle(got, target)
        if self.planner is not None:
            self.planner.done(self.rollout)
        return version

    def align(self, version: int) -> bool:
        """Before the first generate of a run (start or resume): make the engines hold exactly
        the train side's weights, numbered `version` (the trainer's numbering). A server that was
        already running may hold another run's refitted weights, whatever version it reports, so
        they are pushed, every tensor; only an engine this run built from the trainer's model
        (`RolloutSide.engine_holds_model`) still at version 0, when `version` is 0, is left as
        it is. Every rank calls it (a push gathers); returns whether weights were sent."""
        send = True
        if self.dist.is_main and self.rollout is not None:
            fresh = version == 0 and bool(getattr(self.rollout, "engine_holds_model", False))
            send = not (fresh and self.rollout.weight_version() == 0)
        if self.dist.distributed:
            send = bool(broadcast_object(send, self.dist))
        if send:
            self.push(version=version)
        else:
            self.weight_version = version
        return send

    def _settle(self, got: int | None, target: int) -> int:
        """Check the engine's reported version (rank 0) and share it with every rank."""
        if self.dist.is_main and self.rollout is not None and got != target:
            raise WeightSyncError(
                f"weight sync ({self.mode}): asked the engine for version {target}, it reports {got}; "
                "the engine may have been updated by someone else or failed to load the weights"
            )
        self.weight_version = int(broadcast_object(got, self.dist) if self.dist.distributed else target)
        return self.weight_version

    def close(self) -> None:
        """Release the transport (the distributed mode's group); safe to call more than once."""
        if self.transport is not None:
            self.transport.close()


def _table(mode: WeightSyncSection | str, options: dict[str, Any]) -> dict[str, Any]:
    base = mode.model_dump() if isinstance(mode, WeightSyncSection) else {"type": mode}
    return {**base, **options}
