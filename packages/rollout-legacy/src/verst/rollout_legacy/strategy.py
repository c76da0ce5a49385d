"""`LegacyRolloutStrategy`: the v1 `generate_rollout` behind the `RolloutStrategy` protocol.

The trainer drives every rollout through `RolloutStrategy`; this wrapper lets it drive the
legacy function-based path the same way. It builds one `LegacyRuntime` and one v1 args
namespace from its context at construction, and per request runs the synchronous
`generate_rollout` in a worker thread (the engine stays on the trainer's event loop) and boxes
its output into a `RolloutResult`.

Selected only by opt-in (`VERST_USE_LEGACY_ROLLOUT_V1=1`, see `verst.rollout.selection`).
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from verst.rollout.protocols import Capability, GenerateState, RolloutContext, RolloutRequest, RolloutResult
from verst.rollout_legacy.rollout import (
    RolloutFnEvalOutput,
    RolloutFnTrainOutput,
    build_legacy_args,
    generate_rollout,
)
from verst.rollout_legacy.runtime import LegacyRuntime

STATE_VERSION = 1
"""Version of `LegacyRolloutStrategy.state_dict()`'s layout."""

LEGACY_CAPABILITIES = frozenset(
    {
        Capability.PARTIAL_ROLLOUT,
        Capability.MASK_OFFPOLICY_IN_PARTIAL_ROLLOUT,
        Capability.DYNAMIC_FILTER,
        Capability.OVER_SAMPLING,
        Capability.GROUP_REWARD,
        Capability.CUSTOM_GENERATE_FUNCTION,
        Capability.PER_SAMPLE_GENERATE_OVERRIDE,
        Capability.EVAL,
        Capability.LIFECYCLE_EVENTS,
        Capability.OPD_SAMPLED_TOKEN,
        Capability.OPD_TOP_K,
        Capability.RESUMABLE_STATE,
    }
)
"""What the legacy path can do. Not FULLY_ASYNC: a v1 rollout function owns one synchronous
rollout from start to end (it cannot keep generating while the trainer trains). OPD (sampled
token and top-k) is supported because the legacy path delivers the same `Sample` structure as the
default one, and the trainer computes the student's top-k itself and scores the teacher after
the rollout."""


class LegacyRolloutStrategy:
    """The legacy (v1) function-based rollout, driven like any other strategy.

    Holds a `LegacyRuntime` (engine, tokenizer, rewards, sink, eval datasets, config) and a
    read-only v1 args namespace (`self.args`, carrying `args.runtime`), both built once from
    the context. Its only own state is bookkeeping: partial samples go back to the data source,
    whose state the trainer checkpoints.
    """

    capabilities: ClassVar[frozenset[Capability]] = LEGACY_CAPABILITIES

    def __init__(self, context: RolloutContext) -> None:
        self.context = context
        """The context the strategy was built from."""
        self.runtime = LegacyRuntime(context=context)
        """What `generate_rollout` reaches the engine, tokenizer and sink through."""
        self.args = build_legacy_args(self.runtime)
        """The v1 args namespace handed to `generate_rollout` (read-only; `args.runtime` set)."""
        self.num_rollouts = 0
        """Training rollouts produced so far."""
        self.last_rollout_id: int | None = None
        """The id of the last training rollout."""
        self._in_flight: asyncio.Future[Any] | None = None
        self._closed = False

    async def __call__(self, request: RolloutRequest) -> RolloutResult:
        """Run `generate_rollout` for this request in a worker thread and box its output."""
        if self._closed:
            raise RuntimeError("LegacyRolloutStrategy is closed; build a new one to generate again")
        self.runtime.weight_version = request.weight_version
        self.runtime.loop = asyncio.get_running_loop()
        call = asyncio.ensure_future(
            asyncio.to_thread(
                generate_rollout,
                self.args,
                request.rollout_id,
                self.context.data_source,
                request.evaluation,
            )
        )
        self._in_flight = call
        try:
            output = await asyncio.shield(call)
        except asyncio.CancelledError:
            # The worker thread cannot be cancelled: stop the rollout instead, so it hands its
            # unfinished groups back to the data source and the thread ends.
            await self._stop_rollout(call)
            raise
        finally:
            self._in_flight = None
        if request.evaluation:
            return box_eval_output(output)
        self.num_rollouts += 1
        self.last_rollout_id = request.rollout_id
        return box_train_output(output)

    def state_dict(self) -> dict[str, Any]:
        """Bookkeeping only; buffered partial samples live in the data source's state."""
        return {
            "version": STATE_VERSION,
            "num_rollouts": self.num_rollouts,
            "last_rollout_id": self.last_rollout_id,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict`."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"LegacyRolloutStrategy state version {state.get('version')!r} is not {STATE_VERSION}; "
                "resume with the verst-rollout-legacy version that wrote the checkpoint"
            )
        self.num_rollouts = int(state["num_rollouts"])
        self.last_rollout_id = state["last_rollout_id"]

    async def close(self) -> None:
        """Stop an in-flight rollout (its unfinished samples go back to the data source) and
        close the generate functions it loaded that have a `close`."""
        self._closed = True
        if self._in_flight is not None:
            await self._stop_rollout(self._in_flight)
        for fn in self.runtime.generate_fn_cache.values():
            close = getattr(fn, "close", None)
            if close is not None:
                out = close()
                if asyncio.iscoroutine(out):
                    await out
        self.runtime.generate_fn_cache.clear()

    async def _stop_rollout(self, call: asyncio.Future[Any]) -> None:
        """Set the running rollout's abort flag, abort its engine requests, wait for it to end."""
        stopped: GenerateState | None = None
        while not call.done():
            state = self.runtime.current_state  # None until the worker thread has started it
            if state is not None and state is not stopped:
                state.aborted.set()
                await self.runtime.engine.abort(state.request_prefix + "-")
                stopped = state
            await asyncio.wait([call], timeout=0.05)
        await asyncio.gather(call, return_exceptions=True)


def box_train_output(output: Any) -> RolloutResult:
    """A v1 training output (`RolloutFnTrainOutput` or a bare list of groups) → `RolloutResult`."""
    if isinstance(output, RolloutFnTrainOutput):
        return RolloutResult(groups=list(output.samples), metrics=dict(output.metrics))
    if isinstance(output, list):
        return RolloutResult(groups=output)
    raise TypeError(
        f"generate_rollout returned {type(output).__name__} for a training rollout; "
        "expected RolloutFnTrainOutput or a list of groups (list[list[Sample]])"
    )


def box_eval_output(output: Any) -> RolloutResult:
    """A v1 eval output (`RolloutFnEvalOutput` or a dict name → groups) → `RolloutResult`."""
    if isinstance(output, RolloutFnEvalOutput):
        return RolloutResult(eval=dict(output.data), metrics=dict(output.metrics))
    if isinstance(output, dict):
        return RolloutResult(eval=output)
    raise TypeError(
        f"generate_rollout returned {type(output).__name__} for an eval rollout; "
        "expected RolloutFnEvalOutput or a dict of eval dataset name → groups"
    )
