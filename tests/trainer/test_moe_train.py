"""Routing replay in training, on a real tiny MoE served by the embedded engine.

The engine's copy of the model keeps its router weights in bfloat16 precision, the trainer all in
float32: the two pick different experts on some tokens, as bf16 engines and fp32 trainers do on
GPUs, while every other weight and op is the same. Without replay the trainer's log-probs of the engine's
tokens then differ; with R3 (the engine's recorded experts) they agree to float32 rounding, in
every layout. R2 replays the old pass's own choices; config errors name the key and the fix."""

from __future__ import annotations

import asyncio
import math
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from moe_testlib import moe_side

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.errors import ConfigError
from verst.rollout.moe import find_routers
from verst.rollout.sample import Sample, Status
from verst.rollout.toy import build_char_tokenizer
from verst.rollout.toy_moe import build_tiny_moe
from verst.trainer.algorithms import AlgorithmConfig
from verst.trainer.config import TrainConfig, run_config_from_dict, validate_run_config
from verst.trainer.train.batch import build_train_batch
from verst.trainer.train.moe import MoeSection
from verst.trainer.train.side import TrainSide


def make_moe(path: Path) -> Path:
    """The tiny Qwen3-MoE (8 experts, top-2, 2 layers), saved in float32."""
    tok = build_char_tokenizer()
    model = build_tiny_moe(
        "qwen3_moe",
        len(tok),
        num_layers=2,
        seed=3,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def bf16_routers(model: torch.nn.Module) -> None:
    """The engine's copy keeps its router weights in bfloat16 precision (as a bf16 checkpoint or
    engine does); everything else is the trainer's float32 model."""
    with torch.no_grad():
        for _, router in find_routers(model):
            router.weight.copy_(router.weight.to(torch.bfloat16).float())


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> Path:
    return make_moe(tmp_path_factory.mktemp("moe") / "m")


PROMPTS = ["12+34=", "7*8=", "99-1=", "5+5=", "31-4=", "6*6="]


@pytest.fixture(scope="module")
def rollout(tied) -> list[list[Sample]]:
    """Six groups of four samples from the engine (bf16 router weights), with recorded routing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verst.rollout.engines.embedded import EmbeddedEngine

    tok = AutoTokenizer.from_pretrained(tied)
    model = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32)
    bf16_routers(model)

    async def run() -> list[list[Sample]]:
        engine = EmbeddedEngine(model, tok, batch_wait_s=0.05)
        groups = []
        try:
            for g, prompt in enumerate(PROMPTS):
                ids = tok(prompt, add_special_tokens=False)["input_ids"]
                reqs = [
                    GenerateRequest(
                        ids,
                        SamplingParams(
                            max_new_tokens=6, temperature=1.0, sampling_seed=10 * g + j, ignore_eos=True
                        ),
                        return_routed_experts=True,
                    )
                    for j in range(4)
                ]
                outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
                groups.append(
                    [
                        Sample(
                            prompt=prompt,
                            tokens=ids + o.output_ids,
                            response_length=len(o.output_ids),
                            rollout_logprobs=o.output_logprobs,
                            routed_experts=o.routed_experts,
                            reward=float(j % 2),
                            status=Status.COMPLETED,
                            group_index=g,
                            sample_index=4 * g + j,
                        )
                        for j, o in enumerate(outs)
                    ]
                )
        finally:
            await engine.close()
        return groups

    return asyncio.run(run())


def _side(model: Path, **moe) -> TrainSide:
    layout = moe.pop("layout", "padded")
    cfg = TrainConfig(
        model_path=str(model),
        lr=1e-3,
        micro_batch_size=8,
        num_threads=1,
        layout=layout,
        moe=MoeSection(**moe),
    )
    return TrainSide(
        cfg,
        AlgorithmConfig(),
        model_path=str(model),
        total_steps=2,
        max_response_len=6,
        temperature=1.0,
        env={},
    )


@pytest.mark.parametrize("layout", ["padded", "packed", "shared_prompt"])
def test_r3_gives_the_engines_logprobs_where_free_routing_does_not(tied, rollout, layout) -> None:
    torch.set_num_threads(1)
    batch = build_train_batch(rollout)
    assert all(r is not None for r in batch.routed_experts)
    mask = batch.loss_mask.bool()
    free_side = _side(tied, routing_replay="off", layout=layout)
    free_side.moe.begin_step(batch.tokens, batch.response_lengths, batch.routed_experts)
    free = free_side.compute_old_logprobs(batch)
    agreement = free_side.moe.step_metrics()["moe/routing_agreement"]
    replay_side = _side(tied, routing_replay="rollout", layout=layout)
    replay_side.moe.begin_step(batch.tokens, batch.response_lengths, batch.routed_experts)
    replayed = replay_side.compute_old_logprobs(batch)
    engine = batch.rollout_logprobs
    without = (free - engine).abs()[mask].max().item()
    with_r3 = (replayed - engine).abs()[mask].max().item()
    assert agreement < 1.0, agreement  # the trainer's float32 routers flip some of the engine's choices
    assert without > 1e-3, without
    assert with_r3 < 1e-4, with_r3
    # the replayed forward used exactly the engine's experts: agreement 1.0 at every recorded position
    assert replay_side.moe.step_metrics()["moe/replay_agreement"] == 1.0
    assert free_side.moe.step_metrics()["moe/replay_agreement"] == agreement  # no replay: its own


def test_r3_and_r2_train_steps_report_routing_metrics(tied, rollout) -> None:
    torch.set_num_threads(1)
    batch = build_train_batch(rollout)
    r3 = _side(tied, routing_replay="rollout", aux_loss_coef=0.01).train_step(batch)
    assert r3["train/moe/routing_agreement"] < 1.0
    assert r3["train/logprob_mismatch"] < 1e-5  # mean over tokens, with R3
    assert r3["train/moe/logprob_mismatch_no_replay"] > 10 * r3["train/logprob_mismatch"]
    assert r3["train/moe_aux_loss"] > 0 and all(math.isfinite(v) for v in r3.values())
    assert any(k.startswith("train/moe/expert_load_max_l") for k in r3)
    side = _side(tied, routing_replay="old_policy")
    r2 = side.train_step(batch)
    assert all(math.isfinite(v) for v in r2.values())


class RouterSpy:
    """Per forward of the trainer (with its phase): the table row of each laid-out position, the
    experts each router picked itself (`free`) and those the MoE block then used (`used`), read by
    hooks before and after the replay hooks, independently of `RouterHooks`."""

    def __init__(self, side: TrainSide) -> None:
        self.forwards: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._now: dict[str, dict[int, torch.Tensor]] = {"free": {}, "used": {}}
        for layer, router in find_routers(side.bundle.hf_model):
            router.register_forward_hook(self._keep("free", layer), prepend=True)
            router.register_forward_hook(self._keep("used", layer))
        runtime, around = side.moe, side.moe.around

        @contextmanager
        def spied(layout, rows, phase, **kw):
            index = runtime.positions(layout, rows, kw.get("groups")) if rows else None
            self._now = {"free": {}, "used": {}}
            with around(layout, rows, phase, **kw):
                yield
            if index is not None:
                free, used = (torch.stack([v[k] for k in sorted(v)], 1) for v in self._now.values())
                self.forwards.append((phase, index, free, used))

        runtime.around = spied

    def _keep(self, what: str, layer: int):
        def hook(module, args, output):
            self._now[what][layer] = output[2].detach().clone()  # top_k_index [N, k]

        return hook


def test_r2_replays_the_old_policys_own_experts_exactly(tied, rollout) -> None:
    """R2 with two updates per rollout and a large step: the second update's routers would pick
    other experts (their weights moved), yet every current-policy forward uses, at every real
    position, exactly the experts the old-policy pass chose there."""
    torch.set_num_threads(1)
    batch = build_train_batch(rollout)
    side = moe_side(
        str(tied),
        total_steps=1,
        moe={"routing_replay": "old_policy"},
        lr=0.05,
        num_updates_per_rollout=2,
        micro_batch_size=8,
        layout="padded",
    )
    spy = RouterSpy(side)
    side.train_step(batch)
    old_choices: dict[int, list[torch.Tensor]] = {}
    for phase, index, free, used in spy.forwards:
        if phase == "old":
            assert torch.equal(free, used)  # the old pass routes freely
            for pos, ids in zip(index.tolist(), used, strict=True):
                if pos >= 0:
                    old_choices.setdefault(pos, []).append(ids)
    table = side.moe.old
    # the old pass recorded every input position (a group's prompt: in its first sample's rows)
    for i, seq in enumerate(batch.tokens):
        rows = table.encoded(batch.tokens, batch.response_lengths, [i])[0][: len(seq) - 1]
        assert all(r in old_choices for r in rows), i
    for pos, ids in old_choices.items():  # the table holds what the old pass chose
        assert any(torch.equal(table.ids[pos], c) for c in ids), pos
    current = [f for f in spy.forwards if f[0] == "current"]
    assert len(current) >= 2
    drifted = 0
    for _, index, free, used in current:
        real = index >= 0
        assert torch.equal(used[real], table.ids[index[real]])
        drifted += int((free[real] != used[real]).any(-1).any(-1).sum())
    assert drifted > 0  # without replay the routers would have chosen otherwise


def _run(model: Path, data: Path, **sections) -> dict:
    base = {
        "engine": {"type": "embedded", "model_path": str(model)},
        "train": {"model_path": str(model)},
        "rollout": {"data": {"path": str(data)}},
    }
    for name, update in sections.items():
        base.setdefault(name, {}).update(update)
    return base


def test_replay_on_a_dense_model_is_refused(tmp_path, tiny_checkpoint) -> None:
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    cfg = run_config_from_dict(_run(tiny_checkpoint, data, train={"moe": {"routing_replay": "rollout"}}))
    with pytest.raises(ConfigError) as info:
        validate_run_config(cfg, {})
    (problem,) = [p for p in info.value.problems if p.key == "train.moe.routing_replay"]
    assert "dense" in problem.why and "routing_replay = 'off'" in problem.fix


def test_replay_on_an_moe_family_verst_does_not_record_is_refused_at_validation(tmp_path) -> None:
    """GraniteMoE is an MoE (experts per token, local experts) whose router returns another tuple:
    config validation names it as such, before any model is built, for replay and the aux loss."""
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

    tok = build_char_tokenizer()
    config = GraniteMoeConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    path = tmp_path / "granite"
    GraniteMoeForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    for moe, key in (({"routing_replay": "rollout"}, "routing_replay"), ({"aux_loss_coef": 0.01}, "aux_loss_coef")):
        cfg = run_config_from_dict(_run(path, data, train={"moe": moe}))
        with pytest.raises(ConfigError) as info:
            validate_run_config(cfg, {})
        (problem,) = [p for p in info.value.problems if p.key == f"train.moe.{key}"]
        assert "'granitemoe'" in problem.why and "does not record" in problem.why, problem.why
        assert "dense" not in problem.why and "qwen3_moe" in problem.why
        assert "routing_replay = 'off'" in problem.fix


def test_r3_with_an_engine_that_cannot_record_is_refused(tmp_path, tied) -> None:
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    engine = {"type": "sglang", "urls": ["http://127.0.0.1:1"]}
    cfg = run_config_from_dict(_run(tied, data, engine=engine, train={"moe": {"routing_replay": "rollout"}}))
    assert cfg.rollout.return_routed_experts  # R3 asks the engine for its experts by itself
    with pytest.raises(ConfigError) as info:
        validate_run_config(cfg, {})
    (problem,) = [p for p in info.value.problems if p.key == "train.moe.routing_replay"]
    assert "routing_replay=False" in problem.why
    assert "engine.routed_experts = true" in problem.fix and "old_policy" in problem.fix
    ok = run_config_from_dict(
        _run(
            tied,
            data,
            engine={**engine, "routed_experts": True},
            train={"moe": {"routing_replay": "rollout"}},
        )
    )
    assert ok.engine.capabilities().routing_replay
