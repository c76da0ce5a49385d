"""The fully-async strategy's own options (`FullyAsyncRollout.Options`), read from
`rollout.strategy_options` when `rollout.fully_async = true`:

```toml
[rollout]
fully_async = true
[rollout.strategy_options]
max_weight_staleness = 1    # a group may lag the trainer's weights by this many versions
async_buffer_groups = 16    # finished groups buffered (plus in flight) at most
stale_policy = "retry"      # too-stale groups: retry (hand back) or drop
```

A small module of its own so the trainer's config (the TIS default) and validation can read the
options without importing the strategy. Configs written before these keys moved keep loading:
`RolloutConfig` moves flat `rollout.max_weight_staleness` / `async_buffer_groups` /
`stale_policy` into `strategy_options` (`verst.rollout.config.migrate_fully_async_keys`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class FullyAsyncOptions(BaseModel):
    """Bounded staleness and the bounded buffer of `FullyAsyncRollout`."""

    model_config = ConfigDict(extra="forbid")

    max_weight_staleness: int = Field(
        1, ge=0, description="Max weight versions a group may lag (0 = synchronous training)."
    )
    async_buffer_groups: int = Field(16, ge=1, description="Finished groups buffered at most.")
    stale_policy: Literal["retry", "drop"] = Field(
        "retry", description="What happens to groups that are too stale (or came back aborted)."
    )


def fully_async_options(strategy_options: Mapping[str, Any]) -> FullyAsyncOptions:
    """The fully-async options among `rollout.strategy_options` (defaults for the missing ones;
    keys of a subclass's own options are ignored here)."""
    return FullyAsyncOptions.model_validate(
        {k: v for k, v in strategy_options.items() if k in FullyAsyncOptions.model_fields}
    )
