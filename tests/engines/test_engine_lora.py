"""Multi-LoRA serving: the embedded engine holds the base once and decodes rows of different
adapters (and of none) in one batch, each with its own adapter's log-probs (checked against
PEFT); load / replace / unload; `verst serve` speaks SGLang 0.5.23's LoRA API (launch flags,
`/load_lora_adapter`, `/load_lora_adapter_from_tensors`, `/unload_lora_adapter`, per-request
`lora_path`) to the SGLang client."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch
from aiohttp import web

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.common.errors import InvalidRequest
from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.engines.serve.server import build_app
from verst.rollout.engines.sglang.client import SGLangClient
from verst.rollout.engines.sglang.launcher import free_port

PROMPT = [1, 8, 9, 10, 11, 12]


def _peft(model_dir, seed: int, rank: int, targets: list[str]):
    """A PEFT model with a random (non-zero) adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(base, config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.mul_(3.0)  # big enough that greedy outputs differ between adapters
    return model


def _tensors(model):
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model), model.peft_config["default"].to_dict()


def _logprobs(model, prompt, output):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    a = _peft(tiny_checkpoint, 1, 4, ["q_proj", "v_proj"])
    b = _peft(tiny_checkpoint, 2, 8, ["o_proj", "up_proj", "down_proj"])
    folder = tmp_path_factory.mktemp("adapters")
    a.save_pretrained(folder / "a")
    b.save_pretrained(folder / "b")
    return {"a": a, "b": b, "dir": folder}


async def test_two_adapters_and_the_base_in_one_batch(tiny_checkpoint, adapters):
    torch.set_num_threads(1)
    engine = EmbeddedEngine.from_pretrained(tiny_checkpoint, batch_wait_s=0.05)
    try:
        assert await engine.load_lora_adapter("a", str(adapters["dir"] / "a")) == 0
        t, c = _tensors(adapters["b"])
        assert await engine.load_lora_adapter_from_tensors("b", t, c, weight_version=3) == 3
        assert engine.lora_adapters == {"a": str(adapters["dir"] / "a"), "b": "__tensor__"}
        names = [None, "a", "b"] * 4
        reqs = [
            # different lengths: finished rows' slots linger while the others decode (routing by slot)
            GenerateRequest(PROMPT, SamplingParams(max_new_tokens=4 + i, sampling_seed=i), lora_path=n)
            for i, n in enumerate(names)
        ]
        outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
        assert engine.peak_batch >= 6  # the adapters really shared decode steps
        base = adapters["a"].get_base_model()
        for r, o in zip(reqs, outs, strict=True):
            if r.lora_path is None:
                with adapters["a"].disable_adapter():
                    ref = _logprobs(base, PROMPT, o.output_ids)
            else:
                ref = _logprobs(adapters[r.lora_path], PROMPT, o.output_ids)
            err = float((ref - torch.tensor(o.output_logprobs)).abs().max())
            assert err < 1e-4, (r.lora_path, err)
        greedy = [
            GenerateRequest(PROMPT, SamplingParams(max_new_tokens=10, temperature=0), lora_path=n)
            for n in (None, "a", "b")
        ]
        texts = [o.output_ids for o in await asyncio.gather(*(engine.generate(g) for g in greedy))]
        assert len({tuple(x) for x in texts}) == 3  # each adapter changes the output

        # replace "a" with "b"'s weights under the same name: "a" requests now follow b
        assert await engine.load_lora_adapter_from_tensors("a", t, c, weight_version=4) == 4
        again = await engine.generate(greedy[1])
        assert again.output_ids == texts[2] and again.weight_version == 4
        await engine.unload_lora_adapter("a")
        with pytest.raises(InvalidRequest, match="not loaded"):
            await engine.generate(greedy[1])
        assert (await engine.generate(greedy[0])).output_ids == texts[0]  # base untouched
        bad = {k.replace("q_proj", "nope_proj"): v for k, v in _tensors(adapters["a"])[0].items()}
        with pytest.raises(InvalidRequest, match="nope_proj"):
            await engine.load_lora_adapter_from_tensors("c", bad, c)
    finally:
        await engine.close()


async def test_adapters_route_per_prefill_group(tiny_checkpoint, adapters):
    """Prompts of different lengths per adapter: the prefill runs a forward per length group;
    each row keeps its adapter's log-probs."""
    torch.set_num_threads(1)
    engine = EmbeddedEngine.from_pretrained(tiny_checkpoint, batch_wait_s=0.05)
    engine._batch.prefill_group_cost = 0.0  # a forward per prompt length
    forwards: list[int] = []
    hook = engine.model.register_forward_pre_hook(
        lambda _m, args, kwargs: forwards.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        await engine.load_lora_adapter("a", str(adapters["dir"] / "a"))
        t, c = _tensors(adapters["b"])
        await engine.load_lora_adapter_from_tensors("b", t, c)
        names = [None, "a", "b", "a", None, "b"]
        prompts = [(PROMPT * 2)[: 2 + 2 * i] for i in range(len(names))]  # lengths 2, 4, ..., 12
        reqs = [
            GenerateRequest(p, SamplingParams(max_new_tokens=5, sampling_seed=i), lora_path=n)
            for i, (p, n) in enumerate(zip(prompts, names, strict=True))
        ]
        outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
        assert sorted(forwards[: len(reqs)], reverse=True) == [12, 10, 8, 6, 4, 2]  # one prefill per length
        base = adapters["a"].get_base_model()
        for r, o in zip(reqs, outs, strict=True):
            if r.lora_path is None:
                with adapters["a"].disable_adapter():
                    ref = _logprobs(base, r.input_ids, o.output_ids)
            else:
                ref = _logprobs(adapters[r.lora_path], r.input_ids, o.output_ids)
            assert float((ref - torch.tensor(o.output_logprobs)).abs().max()) < 1e-4, r.lora_path
    finally:
        hook.remove()
        await engine.close()


async def _serve(model_dir, **info):
    engine = EmbeddedEngine.from_pretrained(model_dir)
    runner = web.AppRunner(build_app(engine, info=info))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}", engine


async def test_verst_serve_speaks_sglang_lora_api(tiny_checkpoint, adapters):
    torch.set_num_threads(1)
    off, off_url, _ = await _serve(tiny_checkpoint)
    runner, url, engine = await _serve(tiny_checkpoint, enable_lora=True)
    client = SGLangClient(url, max_retries=0)
    try:
        async with aiohttp.ClientSession() as s:
            body = {"lora_name": "a", "lora_path": str(adapters["dir"] / "a")}
            async with s.post(off_url + "/load_lora_adapter", json=body) as r:
                data = await r.json()
                assert r.status == 400 and "--enable-lora" in data["error_message"]
            async with s.post(url + "/load_lora_adapter", json=body) as r:
                data = await r.json()
                assert r.status == 200 and data == {
                    "success": True,
                    "error_message": None,
                    "loaded_adapters": {"a": str(adapters["dir"] / "a")},
                }
            async with s.post(url + "/load_lora_adapter", json=body) as r:  # SGLang: names are unique
                assert r.status == 400 and "already exists" in (await r.json())["error_message"]
            gen = {
                "input_ids": [PROMPT, PROMPT],
                "lora_path": ["a", None],
                "sampling_params": {"max_new_tokens": 6, "temperature": 0},
                "return_logprob": True,
            }
            async with s.post(url + "/generate", json=gen) as r:
                a_out, base_out = await r.json()
            assert a_out["output_ids"] != base_out["output_ids"]
            lp = [e[0] for e in a_out["meta_info"]["output_token_logprobs"]]
            ref = _logprobs(adapters["a"], PROMPT, a_out["output_ids"])
            assert float((ref - torch.tensor(lp)).abs().max()) < 1e-4

        # the client's refit: from tensors, replacing the loaded "a" (unload + load), version-checked
        t, c = _tensors(adapters["b"])
        assert await client.load_lora_adapter_from_tensors("a", t, c, weight_version=5) == 5
        assert await client.get_weight_version() == 5 and engine.lora_adapters == {"a": "__tensor__"}
        out = await client.generate(
            GenerateRequest(PROMPT, SamplingParams(max_new_tokens=6, temperature=0), lora_path="a")
        )
        assert out.weight_version == 5
        assert out.output_ids == _greedy(adapters["b"], PROMPT, 6)
        assert await client.load_lora_adapter("b", str(adapters["dir"] / "b"), weight_version=6) == 6
        await client.unload_lora_adapter("a")
        assert engine.lora_adapters == {"b": str(adapters["dir"] / "b")}
        with pytest.raises(InvalidRequest, match="not loaded"):
            await client.generate(GenerateRequest(PROMPT, SamplingParams(max_new_tokens=2), lora_path="a"))
    finally:
        await client.close()
        await runner.cleanup()
        await off.cleanup()


def _greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
