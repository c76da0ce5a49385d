"""The `[run.ray]` section and the layouts: where train actors and the rollout manager sit.

Two layouts, chosen with `run.ray.layout` and validated before anything starts:

- `colocated` (default; verl's "hybrid engine", slime's `--colocate`): one placement group with
  one bundle per train actor; the rollout manager (and its engines) share bundle 0 with train
  rank 0. Rollout and training alternate; the rollout manager asks its engines to release memory
  after every rollout and to take it back before the next engine call (the embedded engine drops
  its KV cache and, on CUDA, moves its weights to CPU; SGLang servers get
  `/release_memory_occupation`).
- `run.ray.engine_actors = N` (either layout): N embedded engines as their own actors, each on
  its own bundle of the placement group (a GPU each on GPU clusters); the rollout manager
  load-balances over them (`actor_engine.ActorEngine` in an `EnginePool`).
- `disaggregated`: the train actors get their own placement group; the rollout manager gets its
  own resources (`run.ray.rollout_num_gpus`), so generation can overlap training. Fully-async
  rollouts require it.

Nothing here imports Ray: the plan is plain data (`plan_placement`) that `ray_cluster` turns into
a placement group and actor options.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import Field

from verst.rollout.config import RolloutConfig, Section
from verst.rollout.engines.config import EngineSection
from verst.rollout.errors import Problem

Layout = Literal["colocated", "disaggregated"]
Device = Literal["cpu", "gpu"]


class RaySection(Section):
    """How `run.placement = "ray"` lays the run out on a Ray cluster."""

    layout: Layout = Field(
        "colocated",
        description=(
            "'colocated' = train actors and the rollout engines share the devices (engines release "
            "memory while training); 'disaggregated' = separate devices (required by fully-async)."
        ),
    )
    num_train_actors: int = Field(
        1, ge=1, description="Train actors (one per GPU on GPU clusters); FSDP shards across them."
    )
    device: Literal["auto", "cpu", "gpu"] = Field(
        "auto",
        description="Train bundles on 'gpu' (one GPU each) or 'cpu'; 'auto' = gpu when the cluster has enough GPUs.",
    )
    cpus_per_train_actor: float = Field(1.0, gt=0, description="CPUs reserved for each train actor.")
    rollout_num_cpus: float = Field(1.0, ge=0, description="CPUs reserved for the rollout manager.")
    rollout_num_gpus: float = Field(
        0.0,
        ge=0,
        description=(
            "disaggregated: GPUs reserved for the rollout manager (its embedded engine, or the SGLang "
            "servers it launches); colocated: ignored (it shares bundle 0)."
        ),
    )
    engine_actors: int = Field(
        0,
        ge=0,
        description=(
            "Embedded engines as their own Ray actors (each on its own bundle: a GPU each on GPU "
            "clusters), load-balanced by the rollout manager; 0 = the engine lives inside the "
            "rollout manager. Needs an engine that can run as one (the embedded engine), with one copy."
        ),
    )
    cpus_per_engine_actor: float = Field(1.0, gt=0, description="CPUs reserved for each engine actor.")
    namespace: str = Field("verst", description="Ray namespace of the run's named actors.")
    log_tail_lines: int = Field(
        30, ge=1, description="Log lines of a failed actor quoted in the error (and kept per actor)."
    )


# ---------------------------------------------------------------- validation


class RunSections(Protocol):
    """The sections the placement checks read: a `verst.trainer.config.RunConfig` (typed
    structurally, so this module does not import the run config that embeds `RaySection`)."""

    @property
    def run(self) -> Any: ...  # RunSection: placement, ray_address, ray
    @property
    def train(self) -> Any: ...  # TrainConfig: fsdp, weight_sync (a WeightSyncSection)
    @property
    def engine(self) -> EngineSection: ...
    @property
    def rollout(self) -> RolloutConfig: ...


def placement_problems(cfg: RunSections, env: Mapping[str, str]) -> list[Problem]:
    """Up-front checks of `run.placement`, `run.ray_address` and `run.ray` (no Ray import)."""
    run = cfg.run
    ray = run.ray
    problems: list[Problem] = []
    if run.placement != "ray":
        if run.ray_address:
            problems.append(
                Problem(
                    "run.ray_address",
                    "a Ray address is set but run.placement is 'local', so it would be ignored",
                    "set run.placement='ray' to run on that cluster, or remove run.ray_address",
                )
            )
        return problems
    if int(env.get("WORLD_SIZE", "1") or 1) > 1:
        problems.append(
            Problem(
                "run.placement",
                "placement='ray' was launched under torchrun (WORLD_SIZE > 1): Ray starts the train "
                "processes itself",
                "start one driver process (`verst train ...`), and set run.ray.num_train_actors instead",
            )
        )
    if cfg.rollout.fully_async and ray.layout == "colocated":
        problems.append(
            Problem(
                "run.ray.layout",
                "fully-async rollout generates while training runs, but a colocated layout makes "
                "the engines release their devices during training",
                "set run.ray.layout='disaggregated' (and run.ray.rollout_num_gpus on GPU clusters)",
            )
        )
    if cfg.train.fsdp and ray.num_train_actors < 2 and ray.device == "cpu":
        problems.append(
            Problem(
                "run.ray.num_train_actors",
                "train.fsdp=true with one CPU train actor would run unsharded",
                "set run.ray.num_train_actors=2 (or more), or train.fsdp=false",
            )
        )
    mode = cfg.train.weight_sync.resolve(cfg.engine.capabilities())
    colocated_gpu = ray.layout == "colocated" and ray.device != "cpu"
    problems += mode.placement_problems("train.weight_sync", colocated_gpu=colocated_gpu)
    problems += engine_placement_problems(cfg)
    return problems


def engine_placement_problems(cfg: RunSections) -> list[Problem]:
    """The engine's capabilities against the Ray layout (devices, engine actors)."""
    ray = cfg.run.ray
    caps = cfg.engine.capabilities()
    kind = f"engine.type={cfg.engine.type!r}"
    problems: list[Problem] = []
    if ray.layout == "colocated" and caps.launched_gpus > 1:
        problems.append(
            Problem(
                "run.ray.layout",
                f"a colocated rollout manager shares train bundle 0 (one device), but engine asks for "
                f"{caps.launched_gpus} GPUs (num_engines x tp_size)",
                "use run.ray.layout='disaggregated' with run.ray.rollout_num_gpus, or one single-GPU engine",
            )
        )
    if ray.layout == "colocated" and getattr(cfg.engine, "memory_saver", True) is False:
        problems.append(
            Problem(
                "engine.memory_saver",
                "a colocated layout releases the engine's memory for training, but the launched SGLang "
                "servers would run without --enable-memory-saver (release is then a no-op) and "
                "--enable-weights-cpu-backup",
                "set engine.memory_saver=true, or run.ray.layout='disaggregated'",
            )
        )
    if ray.engine_actors and not caps.ray_engine_actors:
        problems.append(
            Problem(
                "run.ray.engine_actors",
                f"engine actors run an engine inside each actor, and {kind} cannot run as one "
                "(e.g. SGLang servers are their own processes)",
                "set engine.type='embedded', or run.ray.engine_actors=0",
            )
        )
    elif ray.engine_actors and caps.engine_count != 1:
        problems.append(
            Problem(
                "run.ray.engine_actors",
                f"engine.num_engines={caps.engine_count} and run.ray.engine_actors="
                f"{ray.engine_actors} both ask for several engines",
                "set engine.num_engines=1 and choose the count with run.ray.engine_actors",
            )
        )
    if ray.layout == "disaggregated" and ray.device == "gpu" and ray.rollout_num_gpus == 0 and caps.uses_gpu:
        problems.append(
            Problem(
                "run.ray.rollout_num_gpus",
                "a disaggregated GPU layout gives the rollout manager no GPU for its engines",
                "set run.ray.rollout_num_gpus (e.g. 1), or engine.device='cpu'",
            )
        )
    return problems


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class ActorSlot:
    """Resources of one actor, and the placement-group bundle it is pinned to (None = none)."""

    num_cpus: float
    """CPUs the actor holds."""
    num_gpus: float
    """GPUs the actor holds (fractional when two actors share a device)."""
    bundle: int | None
    """Index of its bundle in the train placement group; None = scheduled on its own."""


@dataclass(frozen=True)
class PlacementPlan:
    """Bundles of the train placement group and the slot of every actor."""

    layout: Layout
    """colocated or disaggregated."""
    device: Device
    """Where the train actors compute."""
    bundles: list[dict[str, float]] = field(default_factory=list)
    """One resource dict per train actor (bundle 0 also holds the colocated rollout manager),
    then one per engine actor."""
    train: list[ActorSlot] = field(default_factory=list)
    """Slot of each train rank."""
    rollout: ActorSlot = ActorSlot(1.0, 0.0, None)
    """Slot of the rollout manager."""
    engines: list[ActorSlot] = field(default_factory=list)
    """Slot of each engine actor (its own bundle, after the train bundles)."""


COLOCATED_GPU_SHARE = 0.5
"""The GPU fraction each of the two actors sharing a colocated device requests from Ray (Ray only
counts it; both processes see the whole device)."""


def plan_placement(ray: RaySection, device: Device) -> PlacementPlan:
    """The bundles and actor slots for `ray` on `device` (pure: property-tested)."""
    gpu = 1.0 if device == "gpu" else 0.0
    engines: list[ActorSlot] = []
    n, cpus = ray.num_train_actors, ray.cpus_per_train_actor
    if ray.layout == "colocated":
        share = COLOCATED_GPU_SHARE if device == "gpu" else 0.0
        bundles = [
            {"CPU": cpus + (ray.rollout_num_cpus if i == 0 else 0.0), **({"GPU": gpu} if gpu else {})}
            for i in range(n)
        ]
        train = [ActorSlot(cpus, share, i) for i in range(n)]
        rollout = ActorSlot(ray.rollout_num_cpus, share, 0)
    else:
        bundles = [{"CPU": cpus, **({"GPU": gpu} if gpu else {})} for _ in range(n)]
        train = [ActorSlot(cpus, gpu, i) for i in range(n)]
        rollout = ActorSlot(ray.rollout_num_cpus, ray.rollout_num_gpus, None)
    for _ in range(ray.engine_actors):
        engines.append(ActorSlot(ray.cpus_per_engine_actor, gpu, len(bundles)))
        bundles.append({"CPU": ray.cpus_per_engine_actor, **({"GPU": gpu} if gpu else {})})
    return PlacementPlan(ray.layout, device, bundles, train, rollout, engines)


def resolve_device(ray: RaySection, cluster_gpus: float) -> Device:
    """'auto' → gpu when the cluster has a GPU for every train actor, else cpu."""
    if ray.device != "auto":
        return ray.device
    return "gpu" if cluster_gpus >= ray.num_train_actors else "cpu"
