"""`[algorithm.critic]`: the value model of PPO with GAE (its own model, optimizer and schedule).

The critic is a separate model: a causal LM's decoder (the policy's checkpoint unless
`model_path` names another) with a linear value head on its last hidden state. Its value of
response token ``t`` is read at the position that predicts ``t`` (the state before the token),
like the policy's log-prob. It has its own AdamW, learning-rate schedule, gradient clipping and
checkpoint folder, and is sharded like the policy under `train.fsdp`; micro-batching and
compute dtype follow `[train]`. The model code is `verst.trainer.train.critic`; this
module is only the config, so `AlgorithmConfig` stays free of model code.
"""

from __future__ import annotations

from pydantic import Field

from verst.rollout.config import path_field
from verst.trainer.algorithms.optimizer_config import AdamWSection


class CriticConfig(AdamWSection):
    """The value model: where it starts from, how it is trained (its own AdamW: `AdamWSection`'s
    fields), when the policy joins in."""

    model_path: str | None = path_field(
        None,
        description="The critic's starting checkpoint (its decoder; a fresh value head). None = train.model_path.",
    )
    lr: float = Field(1e-5, gt=0, description="Peak learning rate of the critic's AdamW.")
    lr_warmup_steps: int = Field(
        0, ge=0, description="Linear learning-rate warmup of the critic (optimizer steps)."
    )
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="Gradient clipping of the critic (None = off)."
    )
    value_clip: float | None = Field(
        0.2,
        gt=0,
        description="Value clipping: the loss is the max of the plain and the clipped (around the "
        "step's old values, +-value_clip) squared error. None = no clipping.",
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        description="Critic warm-up: for the first warmup_steps train steps only the critic is updated "
        "(the policy waits for useful advantages).",
    )
    head_init_std: float = Field(
        0.0, ge=0, description="Std of the value head's initial weights (0 = zeros: every value starts at 0)."
    )
