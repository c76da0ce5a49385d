"""One train step's plan, computed once per step and passed down (the step's data flows one way).

`StepPlan.build(batch, ...)` groups the batch's samples by prompt once, derives the
micro-batch keys from those groups, splits the batch into its mini-batches (one per
`train.num_updates_per_rollout`) and each into this rank's micro-batches, and the whole batch
into the micro-batches of the log-prob passes (old policy, reference). Each `MicroBatch` carries
its prompt groups (positions within the micro-batch), so the layout chooser and the shared-prompt
layout never regroup; `StepPlan.layout` picks each micro-batch's layout once per chooser and
remembers it, so the old, reference and training forwards of one micro-batch agree without
choosing again.

    TrainSide.train_step(batch)
      └─ StepPlan.build(batch)                      groups, keys, mini-batches, micro-batches
           ├─ log-prob passes: plan.all_micro_batches → plan.inputs(chooser, batch, mb) → forward
           └─ per update:      plan.update_micro_batches[u] → plan.inputs(...) → loss → backward
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from verst.trainer.train.batch import micro_batches, split_even
from verst.trainer.train.layout import Layout, PackedInputs, prompt_groups
from verst.trainer.train.layout_choice import LayoutChooser

if TYPE_CHECKING:
    from verst.trainer.train.batch import TrainBatch


@dataclass(frozen=True)
class MicroBatch:
    """This rank's rows of one micro-batch and their prompt groups."""

    rows: tuple[int, ...]
    """Sample indices into the batch (may be empty: ranks run equal counts)."""
    groups: tuple[tuple[int, ...], ...]
    """Positions in `rows` with identical prompts, in order of first appearance."""

    def sequences(self, batch: TrainBatch) -> tuple[list[Any], list[int]]:
        """The micro-batch's token lists and response lengths."""
        return [batch.tokens[i] for i in self.rows], [batch.response_lengths[i] for i in self.rows]


def _local_groups(rows: Sequence[int], group_of: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """`rows` grouped by their batch-level prompt group (positions within `rows`)."""
    out: dict[int, list[int]] = {}
    for pos, row in enumerate(rows):
        out.setdefault(group_of[row], []).append(pos)
    return tuple(tuple(g) for g in out.values())


@dataclass
class StepPlan:
    """The split of one step's batch, computed once (module doc)."""

    keys: list[int]
    """Prompt group of each sample (equal = identical prompt)."""
    updates: list[list[int]]
    """The step's mini-batches (sample indices), one per optimizer update."""
    update_micro_batches: list[list[MicroBatch]]
    """This rank's micro-batches of each mini-batch."""
    all_micro_batches: list[MicroBatch]
    """This rank's micro-batches of the whole batch (the no-grad log-prob passes)."""
    _layouts: dict[tuple[int, tuple[int, ...]], Layout] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls, batch: TrainBatch, *, micro_batch_size: int, num_updates: int, rank: int, world_size: int
    ) -> StepPlan:
        """Group by prompt, then split (samples of a prompt stay in one micro-batch where they fit)."""
        keys = [0] * batch.num_samples
        for gid, members in enumerate(prompt_groups(batch.tokens, batch.response_lengths)):
            for i in members:
                keys[i] = gid

        def split(rows: Sequence[int]) -> list[MicroBatch]:
            mbs = micro_batches(rows, micro_batch_size, rank=rank, world_size=world_size, keys=keys)
            return [MicroBatch(tuple(mb), _local_groups(mb, keys)) for mb in mbs]

        updates = split_even(list(range(batch.num_samples)), num_updates)
        return cls(keys, updates, [split(rows) for rows in updates], split(range(batch.num_samples)))

    def layout(self, chooser: LayoutChooser, batch: TrainBatch, mb: MicroBatch) -> Layout:
        """`chooser`'s layout for `mb`, picked once and remembered."""
        key = (id(chooser), mb.rows)
        if key not in self._layouts:
            tokens, lengths = mb.sequences(batch)
            self._layouts[key] = chooser.pick(tokens, lengths, groups=mb.groups)
        return self._layouts[key]

    def inputs(self, chooser: LayoutChooser, batch: TrainBatch, mb: MicroBatch) -> PackedInputs:
        """`mb` laid out in `chooser`'s (remembered) layout."""
        tokens, lengths = mb.sequences(batch)
        return self.layout(chooser, batch, mb).build(tokens, lengths, groups=mb.groups)
