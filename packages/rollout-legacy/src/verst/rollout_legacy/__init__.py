"""verst legacy (v1) function-based rollout — deprecated, opt-in with `VERST_USE_LEGACY_ROLLOUT_V1=1`.

`generate_rollout(args, rollout_id, data_source, evaluation=False)` is the v1 entry point slime
and miles users know; `LegacyRolloutStrategy` drives it through the `RolloutStrategy` protocol
so the trainer treats it like any other strategy. Depends on `verst-rollout-core` only.
Install with `uv sync --extra legacy` (or `pip install verst[legacy]`); see docs/migration.md.
"""

from verst.rollout_legacy.rollout import (
    RolloutFnEvalOutput,
    RolloutFnTrainOutput,
    generate_rollout,
    sampling_params_from_args,
)
from verst.rollout_legacy.runtime import LegacyRuntime
from verst.rollout_legacy.strategy import LEGACY_CAPABILITIES, LegacyRolloutStrategy

__all__ = [
    "LEGACY_CAPABILITIES",
    "LegacyRolloutStrategy",
    "LegacyRuntime",
    "RolloutFnEvalOutput",
    "RolloutFnTrainOutput",
    "generate_rollout",
    "sampling_params_from_args",
]
