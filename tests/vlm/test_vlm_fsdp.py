"""FSDP2 with a vision-language model on CPU: 2 processes over gloo (forked, as
tests/trainer/test_train_fsdp.py) train the tiny LLaVA, vision tower frozen, on image prompts
and match 1 process: loss, grad norm and the weights after each step. One group is text-only, so
some micro-batches of a rank hold no image (and with 3 groups over 2 ranks one rank runs an
empty micro-batch): the projector must still line up across ranks."""

from __future__ import annotations

import pytest
import torch
from fsdp_testlib import TwoRanks
from vlm_testlib import image_groups

from verst.trainer.algorithms import AlgorithmConfig
from verst.trainer.config import TrainConfig
from verst.trainer.train.batch import build_train_batch
from verst.trainer.train.side import TrainSide

pytestmark = pytest.mark.slow
STEPS = 2


def _side(model: str, env: dict[str, str], fsdp: bool) -> TrainSide:
    # eps=1: the AdamW step is ~linear in small gradients, so weights compare the gradients
    cfg = TrainConfig(model_path=model, fsdp=fsdp, micro_batch_size=2, lr=0.5, eps=1.0, num_threads=1)
    return TrainSide(
        cfg,
        AlgorithmConfig(),
        model_path=model,
        total_steps=STEPS,
        max_response_len=5,
        temperature=1.0,
        env=env,
    )


def _worker(env: dict[str, str], model: str, groups) -> dict:
    side = _side(model, env, fsdp=True)
    metrics = [side.train_step(build_train_batch(groups)) for _ in range(STEPS)]
    weights = side.state_dict_for_sync()  # a collective: full weights on rank 0
    return {"metrics": metrics, "weights": weights, "sharding": side.bundle.sharding}


def test_two_process_fsdp_with_images_matches_one_process(tmp_path, vlm_checkpoints, image_files):
    torch.set_num_threads(1)
    model = str(vlm_checkpoints["llava"])
    groups = image_groups(model, image_files, groups=3, text_only=(1,))
    ranks = TwoRanks(_worker, model, groups, out=tmp_path, timeout_s=300)
    single = _side(model, {}, fsdp=False)
    frozen = {n for n, p in single.bundle.module.named_parameters() if not p.requires_grad}
    assert frozen and all("vision_tower" in n for n in frozen)  # train.vision.freeze (default)
    before = {k: v.clone() for k, v in single.state_dict_for_sync().items()}
    ref_metrics = [single.train_step(build_train_batch(groups)) for _ in range(STEPS)]
    ref = single.state_dict_for_sync()
    r0, _ = ranks.results()
    assert r0["sharding"] == "fsdp2-direct"
    for m_fsdp, m_ref in zip(r0["metrics"], ref_metrics, strict=True):
        assert m_fsdp["train/grad_norm"] == pytest.approx(m_ref["train/grad_norm"], rel=1e-4)
        assert m_fsdp["train/loss"] == pytest.approx(m_ref["train/loss"], rel=1e-4, abs=1e-7)
    assert r0["weights"].keys() == ref.keys()
    for k, v in ref.items():
        torch.testing.assert_close(r0["weights"][k], v, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    # the projector trained, the tower did not (on both sides)
    moved = {k for k in ref if not torch.equal(ref[k], before[k])}
    assert any("multi_modal_projector" in k for k in moved)
    assert not any("vision_tower" in k for k in moved)
