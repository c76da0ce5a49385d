"""The state of one training rollout of `InferenceRollout` (and the counters `FullyAsyncRollout`
extends): `RolloutTally` (counters turned into metrics), `RolloutRun` (the groups of a rollout
in progress), and the small helpers both strategies use on a finished generation task.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from verst.rollout.engine import SamplingParams
from verst.rollout.generate import GroupGenerationError, generate_and_rm_group, reset_sample
from verst.rollout.logging_utils import sample_text_preview
from verst.rollout.protocols import GenerateState, RolloutRequest
from verst.rollout.sample import Sample, Status


@dataclass
class RolloutTally:
    """Counters of one training rollout (turned into metrics at the end)."""

    dropped: dict[str, int] = field(default_factory=dict)
    """Dropped groups per filter reason."""
    failed_groups: int = 0
    """Groups marked FAILED after their retries."""
    group_retries: int = 0
    """Resubmissions of groups whose generation raised."""
    reward_errors: int = 0
    """Samples whose reward function raised."""
    returned_groups: int = 0
    """Unused groups handed back to the data source."""
    aborted_samples: int = 0
    """ABORTED samples among the handed-back groups."""
    generated_tokens: int = 0
    """Response tokens of every finished group (kept or dropped)."""
    finished_groups: int = 0
    """Groups that finished generating (kept, dropped or unfinished)."""
    waves: int = 0
    """Waves of groups pulled from the data source."""
    wave_limit_hit: bool = False
    """The rollout stopped pulling at `max_waves_per_rollout` without a full batch."""
    failure_streak: list[list[Sample]] = field(default_factory=list)
    """Groups that failed (FAILED after retries, or a reward error) since the last good group."""


@dataclass
class RolloutRun:
    """One training rollout of `InferenceRollout` in progress: its groups and counters."""

    request: RolloutRequest
    state: GenerateState
    params: SamplingParams
    tally: RolloutTally = field(default_factory=RolloutTally)
    kept: list[list[Sample]] = field(default_factory=list)
    """Groups of the batch (finished, passed the filters)."""
    unused: list[list[Sample]] = field(default_factory=list)
    """Groups to hand back to the data source (past the batch, unfinished, or the run failed)."""
    failed: list[list[Sample]] = field(default_factory=list)
    """Groups marked FAILED after their retries."""
    in_flight: dict[asyncio.Task[list[Sample]], list[Sample]] = field(default_factory=dict)
    """Generation tasks → their groups."""
    retries: dict[int, int] = field(default_factory=dict)
    """Resubmissions used, per group index."""
    finished: asyncio.Queue[asyncio.Task[list[Sample]]] = field(default_factory=asyncio.Queue)
    """Tasks as they finish (each puts itself here)."""
    next_group: int = 0
    next_sample: int = 0
    exhausted: bool = False
    """No more waves: the data source ran out, or `max_waves_per_rollout` was reached."""

    def numbered(self, group: list[Sample]) -> list[Sample]:
        """`group` with this rollout's next group and sample indices."""
        for s in group:
            s.group_index, s.sample_index = self.next_group, self.next_sample
            self.next_sample += 1
        self.next_group += 1
        return group

    def submit(self, group: list[Sample]) -> None:
        """Start generating `group` (and scoring it)."""
        task = asyncio.create_task(generate_and_rm_group(self.state, group, self.params))
        task.add_done_callback(self.finished.put_nowait)
        self.in_flight[task] = group

    async def next_done(self) -> list[asyncio.Task[list[Sample]]]:
        """The tasks that finished since the last call (waits for at least one). O(1) per
        finished group: asyncio.wait would re-register on every task in flight."""
        done = [await self.finished.get()]
        while not self.finished.empty():
            done.append(self.finished.get_nowait())
        return done

    def requeue_failures(self) -> None:
        """The run stops: FAILED and reward-error groups go back too, as fresh prompts."""
        seen = {id(g) for g in self.failed}
        back = [*self.failed, *(g for g in self.tally.failure_streak if id(g) not in seen)]
        self.unused.extend([reset_sample(s) for s in g] for g in back)
        self.failed = []


def group_of(task: asyncio.Task[list[Sample]], group: list[Sample]) -> list[Sample]:
    """The samples a finished task produced, or the submitted group if it raised, was cancelled
    or is still running (then it is cancelled: its group goes back to the data source)."""
    if not task.done():
        task.cancel()
        return group
    if task.cancelled() or task.exception() is not None:
        return group
    return task.result()


def retryable(err: GroupGenerationError) -> bool:
    """Whether resubmitting the group may help: not for a request the engine refused (4xx)."""
    return bool(getattr(err.cause, "retryable", True))


def mark_failed(group: list[Sample], err: GroupGenerationError) -> list[Sample]:
    """Mark every sample of a group whose generation raised (after its retries) FAILED."""
    message = f"generate: {type(err.cause).__name__}: {sample_text_preview(str(err.cause), 300)}"
    for s in group:
        s.status = Status.FAILED
        s.metadata["error"] = message
    return group
