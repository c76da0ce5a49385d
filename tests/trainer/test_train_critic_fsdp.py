"""The critic under FSDP on CPU: 2 processes over gloo shard it and train like 1 process, and the
gathered checkpoint (critic/state.pt) loads into a 1-process critic.

Forked workers (they inherit the imported modules), one torch thread each, loopback TCP.
Marked slow: `uv run pytest -m slow tests/trainer/test_train_critic_fsdp.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fsdp_testlib import TwoRanks

from verst.rollout.toy import toy_groups
from verst.trainer.algorithms import AlgorithmConfig
from verst.trainer.config import TrainConfig
from verst.trainer.train.batch import build_train_batch
from verst.trainer.train.side import TrainSide

STEPS = 2
# eps=1: AdamW's step is ~linear in small gradients, so weights compare the gradients
ALGO = {"advantage": "gae", "critic": {"lr": 0.05, "eps": 1.0, "head_init_std": 0.02, "value_clip": 0.5}}


def _side(model: str, env: dict[str, str], fsdp: bool) -> TrainSide:
    # eps=1: AdamW's step is ~linear in small gradients, so weights compare the gradients
    cfg = TrainConfig(model_path=model, fsdp=fsdp, micro_batch_size=2, lr=0.5, eps=1.0, num_threads=1)
    return TrainSide(
        cfg,
        AlgorithmConfig(**ALGO),
        model_path=model,
        total_steps=STEPS,
        max_response_len=4,
        temperature=1.0,
        env=env,
    )


def _run(side: TrainSide) -> list[dict[str, float]]:
    batch = build_train_batch(
        toy_groups(
            side.bundle.hf_model.config.vocab_size,
            seed=11,
            groups=2,
            size=3,
            max_response=4,
            reward=lambda g, j: float((g + j) % 2),
        )
    )
    return [side.train_step(batch) for _ in range(STEPS)]


def _worker(env: dict[str, str], model: str, out: str) -> dict:
    from verst.trainer.train.fsdp import is_sharded

    side = _side(model, env, fsdp=True)
    metrics = _run(side)
    assert side.critic is not None
    sharded = {n: is_sharded(p) for n, p in side.critic.module.named_parameters() if p.shape[0] >= 2}
    state = side.critic.state()  # a collective: full state on every rank (cpu_offload: rank 0)
    side.save(Path(out) / "ckpt")  # a collective; rank 0 writes critic/state.pt
    return {"metrics": metrics, "sharded": sharded, "critic": state["model"]}


@pytest.mark.slow  # ~20 s on 2 cores (two forked trainers and a reference, each with a critic)
def test_critic_under_two_process_fsdp_matches_one_process(tmp_path, tiny_checkpoint):
    torch.set_num_threads(1)
    ranks = TwoRanks(_worker, str(tiny_checkpoint), str(tmp_path), out=tmp_path)
    single = _side(str(tiny_checkpoint), {}, fsdp=False)
    ref_metrics = _run(single)
    assert single.critic is not None
    ref = single.critic.state()["model"]
    r0, _ = ranks.results()
    assert r0["sharded"] and all(r0["sharded"].values()), r0["sharded"]
    assert r0["critic"].keys() == ref.keys()
    for k, v in ref.items():
        torch.testing.assert_close(r0["critic"][k], v, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    for m_fsdp, m_ref in zip(r0["metrics"], ref_metrics, strict=True):
        for key in ("train/critic/vf_loss", "train/critic/grad_norm", "train/loss"):
            assert m_fsdp[key] == pytest.approx(m_ref[key], rel=1e-4, abs=1e-7), key
    single.load(tmp_path / "ckpt")  # the gathered FSDP checkpoint loads unsharded
    for k, v in single.critic.state()["model"].items():
        torch.testing.assert_close(v, r0["critic"][k], rtol=0, atol=0)
