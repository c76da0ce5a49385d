"""What a train step measured per sample, kept for the run's trajectory recording.

`StepDetailCollector` is made by `TrainSide.train_step` once the advantages are known: it keeps
every row's mean advantage over its trained tokens (`samples.jsonl`'s advantage column) and, for
the rows the controller asked for (`TrainBatch.record_rows`, the samples recorded in full), the
per-token advantages and the trainer's log-probs at the step's old weights — the values the
loss and `train/logprob_mismatch` used. On several ranks each rank sees only its micro-batches,
so rank 0's detail has log-probs only for its rows (the others stay None).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepRowDetail:
    """Plain lists (they cross Ray and process boundaries), keyed by batch row."""

    sample_advantages: list[float] = field(default_factory=list)
    """Per row: mean advantage over its trained tokens."""
    advantages: dict[int, list[float]] = field(default_factory=dict)
    """Per recorded row: the advantage of each response token."""
    trainer_logprobs: dict[int, list[float]] = field(default_factory=dict)
    """Per recorded row this rank scored: the trainer's log-prob of each response token."""


class StepDetailCollector:
    """Collects one step's `StepRowDetail` (see the module docstring)."""

    def __init__(
        self, advantages: torch.Tensor, mask: torch.Tensor, lengths: list[int], rows: list[int]
    ) -> None:
        # advantages, mask: [B, R]
        adv = advantages.detach().float().cpu()
        m = mask.detach().float().cpu()
        self._lengths = lengths
        self._rows = set(rows)
        self.detail = StepRowDetail(
            sample_advantages=((adv * m).sum(1) / m.sum(1).clamp(min=1)).tolist(),
            advantages={r: adv[r, : lengths[r]].tolist() for r in sorted(self._rows)},
        )

    def add_logprobs(self, rows: list[int], logprobs: torch.Tensor) -> None:
        """The trainer's log-probs `[len(rows), R]` of a micro-batch, at the step's old weights."""
        wanted = [
            (k, r) for k, r in enumerate(rows) if r in self._rows and r not in self.detail.trainer_logprobs
        ]
        if not wanted:
            return
        lp = logprobs.detach().float().cpu()
        for k, r in wanted:
            self.detail.trainer_logprobs[r] = lp[k, : self._lengths[r]].tolist()
