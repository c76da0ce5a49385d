"""LoRA on the language model of a VLM (tiny LLaVA): adapters land in the language model only —
never in the vision tower (whose attention also has q_proj / v_proj and fc1) or the projector
(linear_1), even when the target list names them — the train step runs on image prompts, and the
adapter synced to the embedded engine gives the trainer's log-probs on image prompts."""

from __future__ import annotations

import asyncio

import torch
from run_testlib import write_prompts

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.sample import Sample, Status
from verst.trainer.config import run_config_from_dict
from verst.trainer.run.rollout_side import RolloutSide
from verst.trainer.sync.weight_sync import WeightSync
from verst.trainer.train.batch import build_train_batch
from verst.trainer.train.fsdp import DistInfo
from verst.trainer.train.side import TrainSide

TARGETS = ["q_proj", "v_proj", "down_proj", "fc1", "linear_1"]


def _cfg(model, data, out):
    return run_config_from_dict(
        {
            "run": {"num_steps": 2, "seed": 0, "output_dir": str(out)},
            "engine": {"type": "embedded", "device": "cpu", "max_batch_size": 64},
            "train": {
                "model_path": str(model),
                "lr": 3e-2,
                "micro_batch_size": 4,
                "num_threads": 1,
                "lora": {"rank": 4, "alpha": 8.0, "target_modules": TARGETS},
            },
            "rollout": {
                "batch_size": 2,
                "n_samples_per_prompt": 3,
                "max_response_len": 6,
                "seed": 7,
                "data": {"path": str(data), "seed": 3},
            },
        }
    )


def _image_groups(side: RolloutSide, image_files, lora_path: str) -> list[list[Sample]]:
    """Samples from the engine (with the adapter) on two image prompts, a group of 3 each."""
    vision = side.engine.vision

    async def go():
        groups = []
        for g, text in enumerate(["<image> colour?", "a <image> b"]):
            ex = vision.expand(
                side.tokenizer(text)["input_ids"], [vision.resolve(str(image_files[g]), what="t")]
            )
            reqs = [
                GenerateRequest(
                    ex.input_ids,
                    SamplingParams(max_new_tokens=6, sampling_seed=10 * g + j),
                    lora_path=lora_path,
                    images=tuple(ex.images),
                )
                for j in range(3)
            ]
            outs = await asyncio.gather(*(side.engine.generate(r) for r in reqs))
            recipes = [im.to_dict() for im in ex.images]
            groups.append(
                [
                    Sample(
                        prompt=text,
                        tokens=ex.input_ids + o.output_ids,
                        response_length=len(o.output_ids),
                        rollout_logprobs=o.output_logprobs,
                        reward=float(j == g),
                        status=Status.COMPLETED,
                        group_index=g,
                        sample_index=3 * g + j,
                        images=[dict(d) for d in recipes],
                    )
                    for j, o in enumerate(outs)
                ]
            )
        return groups

    return side._run(go())  # on the rollout side's own loop, where its engine lives


def _mismatch(train: TrainSide, groups) -> float:
    batch = build_train_batch(groups)
    ours = train.compute_old_logprobs(batch)
    return float(((ours - batch.rollout_logprobs).abs() * batch.loss_mask).max())


def test_lora_on_the_vlm_language_model_syncs_to_the_embedded_engine(tmp_path, vlm_checkpoints, image_files):
    torch.set_num_threads(1)
    model = vlm_checkpoints["llava"]
    cfg = _cfg(model, write_prompts(tmp_path / "p.jsonl", n=4), tmp_path / "run")
    train = TrainSide(
        cfg.train,
        cfg.algorithm,
        model_path=str(model),
        total_steps=4,
        max_response_len=6,
        temperature=1.0,
        env={},
    )
    named = dict(train.bundle.module.named_parameters())
    adapters = {n for n in named if ".lora_A." in n or ".lora_B." in n}
    layers = train.bundle.hf_model.config.text_config.num_hidden_layers
    assert len(adapters) == 2 * 3 * layers  # A, B on q_proj, v_proj, down_proj of every LM layer
    assert all(".language_model." in n for n in adapters)
    assert not any(
        k in n for n in adapters for k in ("vision_tower", "multi_modal_projector", "fc1", "linear_1")
    )
    assert {n for n, p in named.items() if p.requires_grad} == adapters

    side = RolloutSide(cfg, model_path=str(model), env={}, engine=EmbeddedEngine.from_pretrained(model))
    try:
        sync = WeightSync(train, side, mode="auto", staging_dir=tmp_path / "w", dist_info=DistInfo())
        assert sync.mode == "tensors" and sync.push(version=0) == 0  # the initial (zero) adapter
        first = _image_groups(side, image_files, "policy")
        assert _mismatch(train, first) < 1e-4
        before = {n: p.detach().clone() for n, p in named.items()}
        metrics = train.train_step(build_train_batch(first))
        assert metrics["train/grad_norm"] > 0
        changed = {n for n, p in named.items() if not torch.equal(p, before[n])}
        assert changed and changed <= adapters  # vision tower, projector and base weights untouched
        assert _mismatch(train, first) > 1e-3  # the step moved the policy on these image prompts
        assert sync.push() == 1
        assert _mismatch(train, _image_groups(side, image_files, "policy")) < 1e-4
    finally:
        side.close()
