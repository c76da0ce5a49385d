"""LoRA under FSDP2 on CPU (2 processes over gloo, as test_train_fsdp does): only the adapter
trains, it matches a 1-process run, the adapter-disabled reference is the base, and the
adapter-only checkpoint written by the sharded run loads into a 1-process model."""

from __future__ import annotations

from pathlib import Path

import torch
from fsdp_testlib import TwoRanks
from test_train_fsdp import _groups

from verst.trainer.algorithms import AlgorithmConfig
from verst.trainer.config import TrainConfig
from verst.trainer.train.batch import build_train_batch
from verst.trainer.train.lora import LoraSection
from verst.trainer.train.side import TrainSide

STEPS = 2


def _side(model: str, env: dict[str, str], fsdp: bool) -> TrainSide:
    cfg = TrainConfig(
        model_path=model,
        fsdp=fsdp,
        micro_batch_size=2,
        lr=0.5,
        eps=1.0,  # AdamW ~linear in small gradients: weights compare the gradients (as test_train_fsdp)
        num_threads=1,
        gradient_checkpointing=True,
        lora=LoraSection(rank=4, target_modules=["q_proj", "v_proj", "up_proj"]),
    )
    algo = AlgorithmConfig(use_kl_loss=True, kl_coef=0.1)
    return TrainSide(
        cfg, algo, model_path=model, total_steps=STEPS, max_response_len=5, temperature=1.0, env=env
    )


def _run(side: TrainSide):
    batch = build_train_batch(_groups(side.bundle.hf_model.config.vocab_size))
    metrics = [side.train_step(batch) for _ in range(STEPS)]
    return batch, metrics


def _worker(env: dict[str, str], model: str, out: str) -> dict:
    torch.manual_seed(0)
    side = _side(model, env, fsdp=True)
    batch, metrics = _run(side)
    result = {
        "sharding": side.bundle.sharding,
        "trainable": sorted(n for n, p in side.bundle.module.named_parameters() if p.requires_grad),
        "metrics": metrics,
        "adapter": side.adapter_state_for_sync(),
        "ref": side.compute_ref_logprobs(batch),
    }
    side.save(Path(out) / "ckpt")
    return result


def test_lora_fsdp_two_processes_match_one(tmp_path, tiny_checkpoint):
    torch.set_num_threads(1)
    ranks = TwoRanks(_worker, str(tiny_checkpoint), str(tmp_path), out=tmp_path)
    torch.manual_seed(0)
    single = _side(str(tiny_checkpoint), {}, fsdp=False)
    batch, ref_metrics = _run(single)
    ref_adapter = single.adapter_state_for_sync()
    ref_ref = single.compute_ref_logprobs(batch)
    r0, r1 = ranks.results()
    assert r0["sharding"] == "fsdp2-direct"
    assert r0["trainable"] and all(".lora_" in n for n in r0["trainable"])
    assert r1["adapter"] == {}  # gathered to rank 0 only
    assert r0["adapter"].keys() == ref_adapter.keys()
    for k, v in ref_adapter.items():
        torch.testing.assert_close(r0["adapter"][k], v, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert any(float(v.abs().max()) > 0 for k, v in ref_adapter.items() if "lora_B" in k)
    for a, b in zip(r0["metrics"], ref_metrics, strict=True):
        assert abs(a["train/loss"] - b["train/loss"]) <= 1e-4 * max(1.0, abs(b["train/loss"]))
        assert abs(a["train/kl"] - b["train/kl"]) <= 1e-5
    torch.testing.assert_close(r0["ref"], ref_ref, rtol=0, atol=1e-5)  # adapter disabled = the base

    # the sharded run's adapter-only checkpoint loads into the 1-process model
    fresh = _side(str(tiny_checkpoint), {}, fsdp=False)
    fresh.load(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["adapter", "train_state.pt"]
    for k, v in fresh.adapter_state_for_sync().items():
        torch.testing.assert_close(v, r0["adapter"][k])
    assert fresh.optimizer_steps == STEPS
