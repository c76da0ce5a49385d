"""Checkpoints of an MoE run: resume continues exactly, and `verst export` writes a folder that
`from_pretrained` loads back with the trained weights.

transformers 5 holds MoE experts fused in memory (`mlp.experts.gate_up_proj`) but
`save_pretrained` writes them per expert (`mlp.experts.<i>.gate_proj.weight`; Mixtral:
`block_sparse_moe.experts.<i>.w1.weight`), so a checkpoint's keys are not the model's: loading
goes through the model's conversion mapping (`verst.trainer.train.hf_keys`). Both families the
project makes are tested (Mixtral in the slow run), on real tiny models built from config, with
R3 on.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from moe_testlib import moe_side, routed_groups
from safetensors.torch import load_file

from verst.rollout.toy_moe import make_tiny_moe_checkpoint
from verst.trainer.cli import main
from verst.trainer.train.batch import build_train_batch
from verst.trainer.train.hf_keys import to_model_keys

STEPS = 4
PER_EXPERT = re.compile(r"experts\.\d+\.")


@pytest.fixture(scope="module", params=["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def moe_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "m"
    return str(make_tiny_moe_checkpoint(path, family=request.param, num_layers=2, seed=1))


def _side(model: str):
    return moe_side(model, total_steps=STEPS, moe={"routing_replay": "rollout"}, lr=1e-2, micro_batch_size=4)


def _disk(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_checkpoint_keys_convert_to_the_models(moe_model, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32)
    model.save_pretrained(tmp_path / "hf")
    on_disk = _disk(tmp_path / "hf")
    live = model.state_dict()
    assert any(PER_EXPERT.search(k) for k in on_disk)  # the layout that broke resume
    assert on_disk.keys() != live.keys()
    converted = to_model_keys(model, on_disk)
    assert converted.keys() == live.keys()
    for k, v in live.items():
        assert torch.equal(converted[k], v), k


def test_resume_continues_exactly_and_export_loads_back(moe_model, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    batch = build_train_batch(routed_groups(n_groups=2))
    straight = _side(moe_model)
    ckpt = tmp_path / "run" / "checkpoints" / "step_2"
    losses = []
    for step in range(1, STEPS + 1):
        losses.append(straight.train_step(batch)["train/loss"])
        if step == 2:
            straight.save(ckpt)
            (ckpt / "meta.json").write_text(json.dumps({"step": 2}))
            saved = {k: v.clone() for k, v in straight.state_dict_for_sync().items()}
    resumed = _side(moe_model)
    resumed.load(ckpt)
    for k, v in resumed.state_dict_for_sync().items():
        assert torch.equal(v, saved[k]), k
    assert [resumed.train_step(batch)["train/loss"] for _ in range(STEPS - 2)] == losses[2:]
    end = straight.state_dict_for_sync()
    for k, v in resumed.state_dict_for_sync().items():
        assert torch.equal(v, end[k]), k

    out = tmp_path / "export"
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert loaded.keys() == saved.keys()
    for k, v in saved.items():
        assert torch.equal(loaded[k], v), k
