"""Per-step engine/trainer log-prob mismatch under `train.exact_on_policy`.

`rollout/mismatch_tokens`: response tokens whose rollout log-prob differs at all from the
trainer's (before the step's updates); `rollout/mismatch_max`: the largest absolute difference.
Both 0 when the setting holds.
"""

from __future__ import annotations

import torch


class MismatchTally:
    """Counts over one step's micro-batches (reset by `metrics`)."""

    def __init__(self) -> None:
        self.tokens = 0
        self.max_diff = 0.0
        self.seen = 0

    def add(self, trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> None:
        """trainer, rollout, mask: [rows, R]; counts the masked (response) tokens only."""
        on = mask > 0
        diff = (trainer.detach().float() - rollout.float()).abs()[on]
        self.tokens += int((diff != 0).sum())  # NaN != 0 counts too
        self.seen += int(on.sum())
        if diff.numel():
            self.max_diff = max(self.max_diff, float(diff.max()))

    def metrics(self) -> dict[str, float]:
        out = {
            "rollout/mismatch_tokens": float(self.tokens),
            "rollout/mismatch_max": self.max_diff,
            "rollout/mismatch_checked_tokens": float(self.seen),
        }
        self.tokens, self.max_diff, self.seen = 0, 0.0, 0
        return out
