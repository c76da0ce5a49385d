"""`[train.lora]` on the train side: only the adapter trains, the reference is the adapter-disabled
base, refits ship the adapter only (embedded engine in-process, `verst serve` from disk and from
tensors) with the trainer's log-probs, checkpoints resume exactly, export loads with
`from_pretrained`, and bad LoRA configs fail before anything loads."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch
from test_train_weight_sync import _max_mismatch, _sample_batch
from train_testlib import install_reward_module, run_dict, write_prompts

from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.engines.sglang.client import SGLangClient
from verst.rollout.engines.sglang.launcher import free_port
from verst.rollout.errors import ConfigError
from verst.rollout.sample import Sample, Status
from verst.trainer.config import run_config_from_dict, validate_run_config
from verst.trainer.run.rollout_side import RolloutSide
from verst.trainer.sync.weight_sync import WeightSync
from verst.trainer.train.batch import build_train_batch
from verst.trainer.train.fsdp import DistInfo
from verst.trainer.train.model import build_reference
from verst.trainer.train.side import TrainSide

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def _side(cfg, model):
    return TrainSide(
        cfg.train,
        cfg.algorithm,
        model_path=str(model),
        total_steps=4,
        max_response_len=8,
        temperature=1.0,
        env={},
    )


def _cfg(model, data, **train):
    return run_config_from_dict(
        run_dict(
            model,
            data,
            train={"lr": 3e-2, "lora": LORA, **train},
            algorithm={"use_kl_loss": True, "kl_coef": 0.1},
        )
    )


@pytest.fixture()
def data(tmp_path):
    return write_prompts(tmp_path / "p.jsonl", n=4)


def test_only_adapter_params_train_with_gradient_checkpointing(tiny_checkpoint, data):
    torch.set_num_threads(1)
    cfg = _cfg(tiny_checkpoint, data, gradient_checkpointing=True)
    train = _side(cfg, tiny_checkpoint)
    module = train.bundle.module
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 3 * train.bundle.hf_model.config.num_hidden_layers  # A, B x 3 modules
    in_opt = {id(p) for g in train.bundle.raw_optimizer().param_groups for p in g["params"]}
    assert in_opt == {id(p) for n, p in module.named_parameters() if n in trainable}
    assert train.bundle.hf_model.is_gradient_checkpointing
    assert train.ref is None  # no reference copy is loaded

    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    groups = [
        [
            Sample(
                prompt="x",
                tokens=[5, 6, 7, 8, 9, 10],
                response_length=3,
                reward=float(j),
                status=Status.COMPLETED,
                group_index=0,
                sample_index=j,
            )
            for j in range(4)
        ]
    ]
    batch = build_train_batch(groups)
    # gradients reach exactly the adapter parameters (checkpointed forward + backward)
    lp, _ = train._forward(module, batch, [0, 1], entropy=False)
    (lp.sum()).backward()
    with_grad = {n for n, p in module.named_parameters() if p.grad is not None}
    assert with_grad == trainable  # the frozen base gets no gradient at all
    assert all(float(p.grad.abs().max()) > 0 for n, p in module.named_parameters() if ".lora_B." in n)
    train.bundle.optimizer.zero_grad(set_to_none=True)
    metrics = train.train_step(batch)
    assert metrics["train/grad_norm"] > 0
    changed = {n for n, p in module.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= trainable  # the base weights are bit-for-bit unchanged


def test_kl_reference_is_the_adapter_disabled_base(tiny_checkpoint, data):
    torch.set_num_threads(1)
    cfg = _cfg(tiny_checkpoint, data)
    train = _side(cfg, tiny_checkpoint)
    engine = EmbeddedEngine.from_pretrained(tiny_checkpoint)
    rollout = RolloutSide(cfg, model_path=str(tiny_checkpoint), env={}, engine=engine)
    try:
        base_groups = _sample_batch(rollout, 0)
        for _ in range(2):  # the adapter moves away from zero
            train.train_step(build_train_batch(base_groups))
        batch = build_train_batch(base_groups)
        ref_disabled = train.compute_ref_logprobs(batch)
        separate = build_reference(
            cfg.train.model_copy(update={"lora": None}), str(tiny_checkpoint), DistInfo()
        )
        ref_separate = train._all_logprobs(separate, batch)
        old = train.compute_old_logprobs(batch)
        mask = batch.loss_mask
        assert float(((old - ref_separate).abs() * mask).max()) > 1e-3  # the adapter changed the policy
        kl_disabled = train.algo.kl_estimator(old - ref_disabled) * mask  # [B, R], the algorithm's estimator
        kl_separate = train.algo.kl_estimator(old - ref_separate) * mask
        assert float(kl_disabled.sum() / mask.sum()) > 1e-4
        assert float((kl_disabled - kl_separate).abs().max()) <= 1e-6
        assert float(((ref_disabled - ref_separate).abs() * mask).max()) <= 1e-6
    finally:
        rollout.close()


def test_adapter_refit_embedded_and_verst_serve(tmp_path, tiny_checkpoint, data):
    torch.set_num_threads(1)
    cfg = _cfg(tiny_checkpoint, data)
    train = _side(cfg, tiny_checkpoint)
    embedded = RolloutSide(
        cfg, model_path=str(tiny_checkpoint), env={}, engine=EmbeddedEngine.from_pretrained(tiny_checkpoint)
    )
    base_state = {k: v.clone() for k, v in embedded.engine.model.state_dict().items()}
    # `verst serve --enable-lora`: its app on a loop in a thread of this process (no subprocess)
    url = f"http://127.0.0.1:{free_port()}"
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    runner = asyncio.run_coroutine_threadsafe(_start_server(tiny_checkpoint, url), loop).result()
    served = RolloutSide(cfg, model_path=str(tiny_checkpoint), env={}, engine=SGLangClient(url))
    try:
        syncs = [
            WeightSync(train, embedded, mode="auto", staging_dir=tmp_path / "we", dist_info=DistInfo()),
            WeightSync(train, served, mode="auto", staging_dir=tmp_path / "ws", dist_info=DistInfo()),
        ]
        assert [s.mode for s in syncs] == ["tensors", "disk"]
        for s in syncs:
            assert s.push(version=0) == 0  # the initial (zero) adapter
        first = _sample_batch(embedded, 0, "policy")
        assert _max_mismatch(train, first) < 1e-4
        train.train_step(build_train_batch(first))
        assert _max_mismatch(train, first) > 1e-3

        adapter_bytes = sum(t.numel() * t.element_size() for t in train.adapter_state_for_sync().values())
        model_bytes = sum(t.numel() * t.element_size() for t in train.state_dict_for_sync().values())
        for s in syncs:
            assert s.push() == 1
            assert s.last_bytes == adapter_bytes < model_bytes / 10
        for side in (embedded, served):
            assert side.weight_version() == 1
            mismatch = _max_mismatch(train, _sample_batch(side, 1, "policy"))
            assert mismatch < 1e-4, f"{side.engine!r}: {mismatch}"
        # the embedded engine kept its base weights: the adapter is applied on top
        for k, v in embedded.engine.model.state_dict().items():
            assert torch.equal(v, base_state[k]), k
        assert [p.name for p in (tmp_path / "ws").iterdir()] == ["v1"]
        assert json.loads((tmp_path / "ws" / "v1" / "adapter_config.json").read_text())["r"] == 4

        # verst serve from tensors (SGLang's /load_lora_adapter_from_tensors), replacing the adapter
        train.train_step(build_train_batch(_sample_batch(served, 1, "policy")))
        by_tensor = WeightSync(
            train,
            served,
            mode="tensors",
            staging_dir=tmp_path / "x",
            dist_info=DistInfo(),
            weight_version=1,
        )
        assert by_tensor.push() == 2 and served.weight_version() == 2
        assert _max_mismatch(train, _sample_batch(served, 2, "policy")) < 1e-4
    finally:
        served.close()
        embedded.close()
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)


async def _start_server(model, url):
    from aiohttp import web

    from verst.rollout.engines.serve.server import build_app

    app = build_app(EmbeddedEngine.from_pretrained(model), info={"enable_lora": True})
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", int(url.rsplit(":", 1)[1])).start()
    return runner


def _adapter(run_dir):
    from safetensors.torch import load_file

    from verst.trainer.run.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert not (ckpt / "model").exists()  # adapter-only checkpoint
    return load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))


def test_lora_resume_is_exact_and_export_loads(tmp_path, tiny_checkpoint, monkeypatch):
    torch.set_num_threads(1)
    reward = install_reward_module(tmp_path, monkeypatch)
    prompts = write_prompts(tmp_path / "p.jsonl", n=5)

    def cfg(steps):
        return run_config_from_dict(
            run_dict(
                tiny_checkpoint,
                prompts,
                run={"num_steps": steps},
                rollout={"reward": {"type": reward}},
                train={"lr": 1e-2, "lora": LORA},
                algorithm={"use_kl_loss": True, "kl_coef": 0.05},
            )
        )

    from verst.trainer.run.controller import InMemoryLogger, run_training

    log = InMemoryLogger()
    straight = run_training(cfg(3), tmp_path / "straight", env={}, logger=log)
    assert straight.weight_version == 3
    assert all(m["sync/bytes"] > 0 for _, m in log.records)
    run_training(cfg(2), tmp_path / "resumed", env={})
    second = run_training(cfg(3), tmp_path / "resumed", env={})
    assert second.start_step == 2 and second.weight_version == 3
    a, b = _adapter(tmp_path / "straight"), _adapter(tmp_path / "resumed")
    assert a.keys() == b.keys()
    assert any(float(v.abs().max()) > 0 for k, v in a.items() if "lora_B" in k)
    for k in a:
        assert torch.equal(a[k], b[k]), k

    # export: the adapter dir (PeftModel.from_pretrained) and the merged model (AutoModel) agree
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from verst.trainer.cli import main

    main(["export", str(tmp_path / "straight"), "--out", str(tmp_path / "adapter")])
    main(["export", str(tmp_path / "straight"), "--merge", "--out", str(tmp_path / "merged")])
    ids = torch.tensor([[5, 9, 12, 7, 30, 8]])
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_checkpoint), tmp_path / "adapter"
    )
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    with torch.no_grad():
        lp_peft = torch.log_softmax(peft_model(ids).logits, -1)
        lp_merged = torch.log_softmax(merged(ids).logits, -1)
        lp_base = torch.log_softmax(base(ids).logits, -1)
    assert float((lp_peft - lp_base).abs().max()) > 1e-4  # the export carries the trained adapter
    torch.testing.assert_close(lp_merged, lp_peft, atol=1e-5, rtol=0)
    assert (tmp_path / "merged" / "tokenizer.json").exists() or any((tmp_path / "merged").glob("tokenizer*"))


def test_bad_lora_configs_fail_before_anything_loads(tiny_checkpoint, data, monkeypatch):
    import transformers

    def no_loading(*args, **kwargs):
        raise AssertionError("validation loaded weights")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    with pytest.raises(ConfigError) as err:
        run_config_from_dict(run_dict(tiny_checkpoint, data, train={"lora": {"rank": 0}}))
    assert "train.lora.rank" in str(err.value)

    cfg = run_config_from_dict(
        run_dict(
            tiny_checkpoint,
            data,
            train={
                "lora": {"target_modules": ["q_proj", "attn_c_proj"]},
                "ref_model_path": str(tiny_checkpoint),
                "weight_sync": "distributed",
            },
        )
    )
    with pytest.raises(ConfigError) as err:
        validate_run_config(cfg, {})
    text = str(err.value)
    assert "train.lora.target_modules: ['attn_c_proj'] are not linear layers" in text
    assert "train.ref_model_path" in text and "adapter disabled" in text
    assert "train.weight_sync" in text


def test_samples_pick_their_adapter_by_metadata(tmp_path, tiny_checkpoint):
    """Multi-LoRA rollout: the trained adapter and a served one share the engine's base; each
    sample's `metadata['lora']` picks its adapter (as OPD samples pick teachers)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from verst.trainer.sync.lora import start_adapters

    torch.set_num_threads(1)
    torch.manual_seed(5)
    tutor = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_checkpoint),
        LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    ).eval()
    tutor.save_pretrained(tmp_path / "tutor")
    rows = [
        {"prompt": f"{i}+{i}=", "label": "x", "metadata": {"lora": "tutor"} if i % 2 else {}}
        for i in range(4)
    ]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = run_config_from_dict(
        run_dict(
            tiny_checkpoint,
            data,
            train={"lora": {**LORA, "serve": {"tutor": str(tmp_path / "tutor")}}},
            rollout={
                "batch_size": 4,
                "n_samples_per_prompt": 2,
                "data": {"path": str(data), "shuffle": False},
            },
        )
    )
    validate_run_config(cfg, {})
    train = _side(cfg, tiny_checkpoint)
    rollout = RolloutSide(cfg, model_path=str(tiny_checkpoint), env={})
    try:
        start_adapters(
            WeightSync(train, rollout, mode="auto", staging_dir=tmp_path / "w", dist_info=DistInfo()),
            cfg.train.lora.serve,
        )
        assert set(rollout.engine.lora_adapters) == {"policy", "tutor"}
        groups = rollout.rollout(0, 0).groups
        picked = {s.metadata.get("lora", "policy") for g in groups for s in g}
        assert picked == {"policy", "tutor"}
        base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
        for g in groups:
            for s in g:
                model = tutor if s.metadata.get("lora") == "tutor" else base  # the fresh policy adapter is 0
                prompt, out = s.tokens[: -s.response_length], s.tokens[-s.response_length :]
                with torch.no_grad():
                    logits = model(torch.tensor([s.tokens])).logits[0, len(prompt) - 1 : -1]
                ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out)[:, None])[:, 0]
                err = float((ref - torch.tensor(s.rollout_logprobs)).abs().max())
                assert err < 1e-4, (s.metadata, err)
                if s.metadata.get("lora") == "tutor":
                    with torch.no_grad():
                        b = torch.log_softmax(
                            base(torch.tensor([s.tokens])).logits[0, len(prompt) - 1 : -1], -1
                        )
                    assert float((b.gather(-1, torch.tensor(out)[:, None])[:, 0] - ref).abs().max()) > 1e-3
    finally:
        rollout.close()


def test_lora_with_an_engine_that_cannot_serve_adapters_is_a_config_error(tiny_checkpoint, data):
    """The check is the engine's declared capability (`lora`), not its type name: the custom
    engine of test_train_custom_engine declares none."""
    raw = run_dict(tiny_checkpoint, data, train={"lora": LORA, "weight_sync": "disk"})
    raw["engine"] = {"type": "test_train_custom_engine:LoopEngine"}
    cfg = run_config_from_dict(raw)
    with pytest.raises(ConfigError) as err:
        validate_run_config(cfg, {})
    assert "engine.type" in str(err.value) and "cannot serve LoRA adapters" in str(err.value)
    # the same run without LoRA validates
    validate_run_config(cfg.model_copy(update={"train": cfg.train.model_copy(update={"lora": None})}), {})
