"""Rollout strategies: `InferenceRollout` (the default) and the dynamic filters it applies.

Import the strategy from its module (`verst.rollout.strategies.inference`); this package only
re-exports the names.
"""

from verst.rollout.strategies.filters import (
    BUILTIN_FILTERS,
    DynamicFilter,
    FilterOutcome,
    load_dynamic_filter,
)
from verst.rollout.strategies.inference import InferenceRollout

__all__ = ["BUILTIN_FILTERS", "DynamicFilter", "FilterOutcome", "InferenceRollout", "load_dynamic_filter"]
