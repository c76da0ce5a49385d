"""LoRA on the attention modules of an MoE model, with routing replay (R3).

The embedded engine serves the tiny Qwen3-MoE with its router weights in bfloat16 precision (so
its experts differ from the float32 trainer's on some tokens) and applies the trainer's adapter
through its LoRA hooks; it records the experts it chose *with the adapter on*. The trainer (PEFT
adapter on q/k/v/o_proj, base frozen) replays them: its log-probs equal the engine's before and
after an adapter update and refit, only the adapter trains, and the routers stay frozen.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_moe_train import PROMPTS, bf16_routers, make_moe
from train_testlib import run_dict, write_prompts

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.sample import Sample, Status
from verst.trainer.config import run_config_from_dict
from verst.trainer.run.rollout_side import RolloutSide
from verst.trainer.sync.weight_sync import WeightSync
from verst.trainer.train.batch import build_train_batch
from verst.trainer.train.fsdp import DistInfo
from verst.trainer.train.side import TrainSide

pytestmark = pytest.mark.slow  # ~18 s of CPU: an engine, a LoRA trainer, two rollouts and a refit
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_moe(tmp_path_factory.mktemp("moe") / "m")


def _groups(side: RolloutSide) -> list[list[Sample]]:
    """Two samples per prompt from the engine with the adapter, routing recorded."""

    async def go():
        groups = []
        for g, prompt in enumerate(PROMPTS[:4]):
            ids = side.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            reqs = [
                GenerateRequest(
                    ids,
                    SamplingParams(max_new_tokens=6, sampling_seed=10 * g + j, ignore_eos=True),
                    lora_path="policy",
                    return_routed_experts=True,
                )
                for j in range(2)
            ]
            outs = await asyncio.gather(*(side.engine.generate(r) for r in reqs))
            groups.append(
                [
                    Sample(
                        prompt=prompt,
                        tokens=ids + o.output_ids,
                        response_length=len(o.output_ids),
                        rollout_logprobs=o.output_logprobs,
                        routed_experts=o.routed_experts,
                        reward=float(j),
                        status=Status.COMPLETED,
                        group_index=g,
                        sample_index=2 * g + j,
                    )
                    for j, o in enumerate(outs)
                ]
            )
        return groups

    return side.submit(go()).result()


def _r3_mismatch(train: TrainSide, groups) -> float:
    """Max |trainer − engine| log-prob over the response tokens, with R3."""
    batch = build_train_batch(groups)
    train.moe.begin_step(batch.tokens, batch.response_lengths, batch.routed_experts)
    replayed = train.compute_old_logprobs(batch)
    mask = batch.loss_mask.bool()
    return float((replayed - batch.rollout_logprobs).abs()[mask].max())


def test_lora_on_attention_trains_with_r3_through_the_engines_adapter(tmp_path, moe) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    data = write_prompts(tmp_path / "p.jsonl", n=4)
    lora = {"rank": 4, "alpha": 8.0, "target_modules": ATTENTION}
    train_cfg = {"lr": 3e-2, "lora": lora, "moe": {"routing_replay": "rollout"}, "micro_batch_size": 8}
    cfg = run_config_from_dict(run_dict(moe, data, train=train_cfg))
    train = TrainSide(
        cfg.train,
        cfg.algorithm,
        model_path=str(moe),
        total_steps=2,
        max_response_len=6,
        temperature=1.0,
        env={},
    )
    module = train.bundle.module
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n and ".self_attn." in n for n in trainable)
    base = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32)
    bf16_routers(base)
    engine = EmbeddedEngine(base, AutoTokenizer.from_pretrained(moe), batch_wait_s=0.05)
    rollout = RolloutSide(cfg, model_path=str(moe), env={}, engine=engine)
    try:
        sync = WeightSync(train, rollout, mode="auto", staging_dir=tmp_path / "w", dist_info=DistInfo())
        assert sync.push(version=0) == 0
        first = _groups(rollout)
        assert all(s.routed_experts is not None for g in first for s in g)
        assert _r3_mismatch(train, first) < 1e-4

        before = {n: p.detach().clone() for n, p in module.named_parameters()}
        metrics = train.train_step(build_train_batch(first))
        assert metrics["train/moe/replay_agreement"] == 1.0
        assert metrics["train/logprob_mismatch"] < 1e-5  # mean over tokens, with R3
        # without replay the float32 routers flip some of the engine's experts
        assert metrics["train/moe/logprob_mismatch_no_replay"] > 10 * metrics["train/logprob_mismatch"]
        assert metrics["train/moe/routing_agreement"] < 1.0
        changed = {n for n, p in module.named_parameters() if not torch.equal(p, before[n])}
        assert changed and changed <= trainable  # experts, routers and the rest stay frozen

        assert _r3_mismatch(train, first) > 1e-3  # the adapter moved the policy
        assert sync.push() == 1  # the adapter only
        second = _groups(rollout)
        assert _r3_mismatch(train, second) < 1e-4  # the engine applied the trained adapter
    finally:
        rollout.close()
