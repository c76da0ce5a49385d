"""Resuming a train side from its checkpoint (#25 items 4, 5): a LoRA adapter saved with another
rank or alpha is refused naming the saved and the configured values (it was a raw size-mismatch
RuntimeError, or for alpha a silently changed scale), and loading an optimizer state keeps the
run's fused AdamW (a checkpoint written before fused AdamW left the run on the slow path)."""

from __future__ import annotations

import pytest
import torch

from verst.rollout.errors import ConfigError
from verst.trainer.algorithms import AlgorithmConfig
from verst.trainer.config import TrainConfig
from verst.trainer.train.side import TrainSide

TARGETS = ["q_proj", "v_proj"]


def _side(model, **train) -> TrainSide:
    torch.set_num_threads(1)
    cfg = TrainConfig(model_path=str(model), lr=1e-3, **train)
    return TrainSide(
        cfg,
        AlgorithmConfig(),
        model_path=str(model),
        total_steps=2,
        max_response_len=4,
        temperature=1.0,
        env={},
    )


@pytest.fixture(scope="module")
def lora_checkpoint(tiny_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("lora-ckpt")
    _side(tiny_checkpoint, lora={"rank": 4, "alpha": 8.0, "target_modules": TARGETS}).save(path)
    return path


@pytest.mark.parametrize(
    ("lora", "needles"),
    [
        ({"rank": 8, "alpha": 8.0}, ["train.lora.rank", "saved with rank = 4", "sets rank = 8"]),
        ({"rank": 4, "alpha": 16.0}, ["train.lora.alpha", "saved with alpha = 8.0", "sets alpha = 16.0"]),
    ],
)
def test_lora_resume_with_another_rank_or_alpha_is_refused_naming_both(
    tiny_checkpoint, lora_checkpoint, lora, needles
):
    side = _side(tiny_checkpoint, lora={**lora, "target_modules": TARGETS})
    with pytest.raises(ConfigError) as info:
        side.load(lora_checkpoint)
    msg = str(info.value)
    assert all(n in msg for n in needles), msg
    _side(tiny_checkpoint, lora={"rank": 4, "alpha": 8.0, "target_modules": TARGETS}).load(lora_checkpoint)


def test_loading_an_optimizer_state_keeps_the_runs_fused_adamw(tiny_checkpoint, tmp_path):
    side = _side(tiny_checkpoint)
    assert side.bundle.raw_optimizer().param_groups[0]["fused"] is True
    side.save(tmp_path)
    state = torch.load(tmp_path / "train_state.pt", weights_only=False)
    for group in state["optimizer"]["param_groups"]:  # as written before fused AdamW
        group["fused"], group["foreach"] = None, None
    torch.save(state, tmp_path / "train_state.pt")
    resumed = _side(tiny_checkpoint)
    resumed.load(tmp_path)
    groups = resumed.bundle.raw_optimizer().param_groups
    assert all(g["fused"] is True for g in groups), [g["fused"] for g in groups]
    assert groups[0]["lr"] == state["optimizer"]["param_groups"][0]["lr"]  # the saved values still load
