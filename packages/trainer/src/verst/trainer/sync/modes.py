"""Weight-sync modes (`train.weight_sync`): one config model per mode, chosen by `type`.

type = "auto"              the engine's preferred mode (the first its capabilities list)
type = "tensors"           the state dict in memory (an engine in the rollout process)
type = "disk"              a Hugging Face checkpoint under `<run>/weights/v<N>/`
type = "distributed"       a broadcast over a dedicated weight-update group (HTTP engines)
type = "pkg.module:Sync"   your own: a class whose nested `Config` subclasses `WeightSyncSection`

A plain name (`train.weight_sync = "disk"`) is the mode with its defaults; a table sets the
mode's own options (`train.weight_sync = {type = "distributed", master_address = "10.0.0.2"}`).

Each mode's config knows `problems(key, caps, engine)` — what the engine's capabilities rule out,
asked both by config validation and by `WeightSync` against the live engine —
`placement_problems(key, colocated_gpu=)`, `resolve(caps)` (the mode that runs: 'auto' picks the
engine's preferred one) and `build(context)`: the `WeightTransport` that moves one version of
the weights. `WEIGHT_SYNCS` is the table; adding a built-in mode is a config class here plus one
entry. `verst.trainer.sync.weight_sync.WeightSync` gathers the weights, asks the transport to push
them, and checks the version the engine reports.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from verst.rollout.config import Section
from verst.rollout.engine import EngineCapabilities
from verst.rollout.errors import Problem
from verst.rollout.variants import VariantTable
from verst.trainer.sync.protocols import (
    RolloutSurface,
    SyncContext,
    TrainSurface,
    WeightSyncError,
    WeightTransport,
)

__all__ = [
    "WEIGHT_SYNCS",
    "AutoSyncConfig",
    "DiskSyncConfig",
    "DistributedSyncConfig",
    "RolloutSurface",
    "ShippedModeConfig",
    "SyncContext",
    "TensorsSyncConfig",
    "TrainSurface",
    "WeightSyncConfig",
    "WeightSyncError",
    "WeightSyncSection",
    "WeightTransport",
    "parse_weight_sync",
]

if TYPE_CHECKING:
    from verst.trainer.sync.distributed import DistributedTransport
    from verst.trainer.sync.plan import Planner

DEFAULT_BUCKET_BYTES = 512 << 20
"""distributed: tensor bytes per update call (SGLang's own refit bucket size)."""


class WeightSyncSection(Section):
    """Base of every weight-sync mode's config."""

    type: str = Field(
        "auto",
        description=(
            "auto (the engine's preferred mode: tensors for the embedded engine, else disk), "
            "tensors, disk, distributed, or an import path 'pkg.module:Sync' (a class with a nested Config)."
        ),
    )

    adapters: ClassVar[bool] = False
    """It can ship a LoRA adapter alone (`[train.lora]`: `verst.trainer.sync.lora`)."""

    def resolve(self, caps: EngineCapabilities) -> WeightSyncSection:
        """The mode that runs with an engine of these capabilities (itself, unless it chooses)."""
        return self

    def problems(self, key: str, caps: EngineCapabilities, engine: str) -> list[Problem]:
        """What an engine with `caps` rules out; `engine` names it in messages (`engine.type='x'`)."""
        return []

    def placement_problems(self, key: str, *, colocated_gpu: bool) -> list[Problem]:
        """What the Ray layout rules out (`colocated_gpu`: trainer and engine share a GPU)."""
        return []

    def build(self, context: SyncContext) -> WeightTransport:
        """The transport of this mode."""
        raise NotImplementedError(f"{type(self).__name__}.build")


class EngineModeConfig(WeightSyncSection):
    """A mode the engine declares by name in `EngineCapabilities.weight_sync`."""

    needs: ClassVar[str] = ""
    """Why the engine must accept it (the start of the message when it does not)."""

    def problems(self, key: str, caps: EngineCapabilities, engine: str) -> list[Problem]:
        if self.type in caps.weight_sync:
            return []
        where = "the engine lives in this process" if caps.in_process else f"{engine} does not accept it"
        return [
            Problem(
                key,
                f"{self.needs}; {where} (it accepts {', '.join(caps.weight_sync)})",
                f"use {' or '.join(repr(m) for m in caps.weight_sync)} (or 'auto') with {engine}, or "
                "serve the model with `verst serve` / SGLang and set engine.type='sglang'",
            )
        ]


class AutoSyncConfig(WeightSyncSection):
    """The engine's preferred mode (the first of its capabilities' weight_sync), with its defaults."""

    type: Literal["auto"] = Field("auto", description="The engine's preferred mode.")

    def resolve(self, caps: EngineCapabilities) -> WeightSyncSection:
        return WEIGHT_SYNCS.parse(caps.weight_sync[0])


class ShippedModeConfig(EngineModeConfig):
    """A mode that ships the state dict itself (tensors, disk): what it may leave out or cast
    (`verst.trainer.sync.plan`)."""

    wire_dtype: Literal["engine", "trained"] = Field(
        "engine",
        description=(
            "engine: float32 weights go in the engine's 16-bit dtype when it reports one "
            "(it would cast them anyway; half the bytes); trained: as trained."
        ),
    )
    every_tensor: bool = Field(
        False,
        description=(
            "Send every state-dict tensor each push, tied aliases and frozen weights too "
            "(false: each tensor once, frozen ones only when the engine may have lost them)."
        ),
    )
    partial: ClassVar[bool] = False
    """The transport can hand the engine a subset of its weights (frozen ones stay home)."""
    written: ClassVar[bool] = False
    """The weights are written out even for an engine in this process (a cast saves bytes)."""

    def planner(self, caps: EngineCapabilities, *, crosses_process: bool) -> Planner:
        """The push planner for an engine of these capabilities (`crosses_process`: the weights
        leave this process, so a cast saves bytes)."""
        from verst.trainer.sync.plan import Planner

        cast = self.wire_dtype == "engine" and (crosses_process or self.written)
        return Planner(
            wire_dtype=caps.weight_dtype if cast else None,
            partial=self.partial and caps.partial_weights and not self.every_tensor,
            aliases=not self.every_tensor,
        )


class TensorsSyncConfig(ShippedModeConfig):
    """In process, no disk: the engine copies the state dict (`update_weights_from_tensors`)."""

    type: Literal["tensors"] = Field("tensors", description="The state dict in memory.")
    needs: ClassVar[str] = "'tensors' hands the engine in-memory weights"
    adapters: ClassVar[bool] = True
    partial: ClassVar[bool] = True

    def build(self, context: SyncContext) -> WeightTransport:
        return TensorsTransport()


class DiskSyncConfig(ShippedModeConfig):
    """A Hugging Face checkpoint under `<run>/weights/v<N>/` that the engine loads (`update_weights_from_disk`)."""

    type: Literal["disk"] = Field("disk", description="A checkpoint directory per version.")
    needs: ClassVar[str] = "'disk' makes the engine load a checkpoint directory"
    adapters: ClassVar[bool] = True
    written: ClassVar[bool] = True

    def build(self, context: SyncContext) -> WeightTransport:
        return DiskTransport(context.train, context.staging_dir)


class DistributedSyncConfig(EngineModeConfig):
    """A broadcast over a dedicated gloo/NCCL weight-update group to the HTTP engines' workers."""

    type: Literal["distributed"] = Field("distributed", description="Broadcast over a weight-update group.")
    needs: ClassVar[str] = "'distributed' broadcasts to an engine in another process"
    master_address: str = Field(
        "127.0.0.1", description="This trainer host's address as the engines reach it (the group's store)."
    )
    backend: Literal["gloo", "nccl"] | None = Field(
        None, description="Process-group backend (None = nccl with CUDA, else gloo)."
    )
    bucket_bytes: int = Field(
        DEFAULT_BUCKET_BYTES, ge=1, description="At most this many tensor bytes per update call."
    )
    group_timeout_s: float = Field(
        120.0, gt=0, description="Seconds to wait for the group's rendezvous and each engine call."
    )

    def placement_problems(self, key: str, *, colocated_gpu: bool) -> list[Problem]:
        if not colocated_gpu or self.backend == "gloo":
            return []
        return [
            Problem(
                key,
                "'distributed' refit over NCCL needs one GPU per rank, but a colocated layout puts the "
                "trainer and the engine on the same GPU (NCCL rejects two ranks on one device)",
                "use train.weight_sync='disk' or 'tensors' with run.ray.layout='colocated', or "
                "run.ray.layout='disaggregated' (or run.ray.device='cpu', where gloo is used)",
            )
        ]

    def build(self, context: SyncContext) -> DistributedTransport:
        from verst.trainer.sync.distributed import DistributedTransport

        return DistributedTransport(self, shares_gpu_with_engine=context.shares_gpu_with_engine)


WEIGHT_SYNCS: VariantTable[WeightSyncSection] = VariantTable(
    "weight-sync mode",
    WeightSyncSection,
    {
        "auto": AutoSyncConfig,
        "tensors": TensorsSyncConfig,
        "disk": DiskSyncConfig,
        "distributed": DistributedSyncConfig,
    },
    default="auto",
)
"""The weight-sync table: built-in `type` → config model (import paths are resolved by the table)."""

WeightSyncConfig = WEIGHT_SYNCS.field
"""The annotation of `train.weight_sync`: the config model its `type` (or plain name) selects."""


def parse_weight_sync(value: Any) -> WeightSyncSection:
    """A mode config from a name, a table or a config (`WeightSync(mode=...)` takes any)."""
    from pydantic import TypeAdapter

    return TypeAdapter(WeightSyncConfig).validate_python(value)


# ---------------------------------------------------------------- the in-process and disk transports


class TensorsTransport:
    """`update_weights_from_tensors`: the engine copies the state dict."""

    def push(self, rollout: RolloutSurface, state: dict, version: int) -> int:
        return rollout.update_weights_from_tensors(state, version)

    def close(self) -> None:
        pass


class DiskTransport:
    """Writes `<staging>/v<N>/`, has the engine load it, then deletes the previous version's folder."""

    def __init__(self, train: TrainSurface, staging_dir: Path) -> None:
        self.train = train
        self.staging_dir = Path(staging_dir)
        self._last_dir: Path | None = None

    def push(self, rollout: RolloutSurface, state: dict, version: int) -> int:
        import shutil

        path = self.staging_dir / f"v{version}"
        if path.exists():
            shutil.rmtree(path)
        self.train.save_hf(path, state)
        got = rollout.update_weights_from_disk(str(path), version)
        if self._last_dir is not None and self._last_dir != path:
            shutil.rmtree(self._last_dir, ignore_errors=True)
        self._last_dir = path
        return got

    def close(self) -> None:
        pass
