"""Ray placement: the same `TrainSide` / `RolloutSide` classes as Ray actors.

`run.placement = "ray"` makes `run_training` build driver-side proxies
(`verst.trainer.placement.proxies`) with the surface of the local sides, so the training loop is
the same code; only where the sides run changes. Importing this package does not import Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from verst.trainer.placement.layout import (
    ActorSlot,
    PlacementPlan,
    RaySection,
    placement_problems,
    plan_placement,
    resolve_device,
)

if TYPE_CHECKING:
    from verst.trainer.placement.proxies import RayPlacement

__all__ = [
    "ActorSlot",
    "PlacementPlan",
    "RaySection",
    "build_ray_placement",
    "placement_problems",
    "plan_placement",
    "resolve_device",
]


def build_ray_placement(*args: Any, **kwargs: Any) -> RayPlacement:
    """Connect to (or start) Ray and start the actors; see `proxies.RayPlacement.start`."""
    from verst.trainer.placement.proxies import RayPlacement

    return RayPlacement.start(*args, **kwargs)
