"""What the trainer asks an engine at run time about refits: the dtype its weights are in
(`reported_weight_dtype`), and what a refit reaches — one `(replica, identity, weight version)`
per engine replica (`replica_states`).

The trainer records them after each push and compares before the next one
(`verst.trainer.sync.plan`): the same list means the engines are the instances it last sent
weights to, at the version it left them, so weights that cannot change need not travel again.
A restarted server (SGLang's and `verst serve`'s `/server_info` `startup_time` changes, its
version starts over), a new router worker, or an update from elsewhere changes the list.
"""

from __future__ import annotations

from typing import Any

ReplicaState = tuple[Any, ...]
"""One replica: who it is (a URL, an index), what instance it is, the version it holds."""


async def replica_states(engine: Any) -> tuple[ReplicaState, ...]:
    """The engine's own `replica_states()` when it has one, else its one reported version."""
    own = getattr(engine, "replica_states", None)
    if own is not None:
        return tuple(await own())
    return ((type(engine).__name__, None, await engine.get_weight_version()),)


async def reported_weight_dtype(engine: Any) -> str | None:
    """The dtype the engine says it holds its weights in (its `reported_weight_dtype()`, or its
    `weight_dtype` attribute), None when it does not say."""
    own = getattr(engine, "reported_weight_dtype", None)
    if own is not None:
        return await own()
    dtype = getattr(engine, "weight_dtype", None)
    return dtype if isinstance(dtype, str) else None
