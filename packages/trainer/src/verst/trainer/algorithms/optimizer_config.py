"""AdamW and its learning-rate schedule: the fields `[train]` and `[algorithm.critic]` share.

Both the policy and PPO's critic own an AdamW (`verst.trainer.train.optim.adamw`) with the same
hyper-parameters and decay; each section subclasses `AdamWSection` and keeps its own warmup (the
policy's `warmup_steps`, the critic's `lr_warmup_steps`) and its own `lr` default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from verst.rollout.config import Section


class AdamWSection(Section):
    """AdamW's hyper-parameters and the learning-rate schedule after the warmup."""

    lr: float = Field(1e-6, gt=0, description="Peak learning rate of AdamW.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    scheduler: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="Learning-rate schedule after warmup (decays over the run's optimizer steps)."
    )
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="Final lr of cosine/linear decay, as a fraction of lr."
    )
