"""Speculative decoding in the embedded engine (`engine.speculative`), on real tiny models: greedy
is token-identical to plain decoding over the examples' prompts, the log-probs returned are the
target's (a plain full forward's), samples follow the target's filtered softmax, a seeded request
is reproducible whatever shares its batch, and batching, prefix sharing, stops, aborts, refits,
LoRA adapters and MoE routing behave as with plain decoding."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.engines.embedded.speculative.config import parse_speculative

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
NGRAM = {"type": "ngram", "num_tokens": 4, "min_ngram": 1, "gate": "off"}  # the verify path on every step
# (the cost gate would send a 2-core CPU box to plain decoding: tests/engines/test_speculative_gate.py)


async def _run(model_dir, reqs, speculative=None, **kwargs):
    engine = EmbeddedEngine.from_pretrained(model_dir, speculative=speculative, batch_wait_s=0.05, **kwargs)
    try:
        return await asyncio.gather(*(engine.generate(r) for r in reqs)), engine.speculative_stats
    finally:
        await engine.close()


def _example_prompts(example: str, n: int) -> tuple[Path, list[list[int]]]:
    from transformers import AutoTokenizer

    model = ROOT / "examples" / example / "model" / "warm_start"
    tok = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in (ROOT / "examples" / example / "data" / "eval.jsonl").open()][:n]
    texts = [r["prompt"] for r in rows]
    if example == "tool_math":  # the second turn: the observation is there to be copied
        texts = [f"{r['prompt']}<tool_response>{r['label']}</tool_response>" for r in rows]
    return model, [tok(t)["input_ids"] for t in texts]


@pytest.mark.parametrize("example", ["reverse_digits", "tool_math"])
async def test_greedy_is_token_identical_to_plain_over_the_examples_prompts(example):
    model, prompts = _example_prompts(example, 24)
    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=24, temperature=0.0), return_logprob=True) for p in prompts]
    plain, _ = await _run(model, reqs)
    spec, stats = await _run(model, reqs, NGRAM)
    assert [o.output_ids for o in spec] == [o.output_ids for o in plain]
    assert [o.finish_reason for o in spec] == [o.finish_reason for o in plain]
    for a, b in zip(spec, plain, strict=True):
        assert torch.allclose(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-5)
    assert stats["accepted"] > 0 and stats["steps"] > 0  # it did speculate


def _reference(model, ids, out, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([ids + out])).logits[0].float()
    lp = torch.log_softmax(logits / (temperature or 1.0), -1)[len(ids) - 1 : -1]
    return lp.gather(-1, torch.tensor(out)[:, None])[:, 0]


async def test_returned_logprobs_are_the_targets_plain_forward(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    settings = [(1.0, -1, 1.0), (0.7, 5, 1.0), (0.0, -1, 1.0), (1.3, -1, 0.8), (0.5, 3, 0.9)]
    prompt = [1] + [4 + j % 6 for j in range(18)]  # repetitive: proposals get accepted
    reqs = [
        GenerateRequest(prompt[: 8 + i], SamplingParams(30, t, p, k, ignore_eos=True, sampling_seed=i), return_logprob=True)
        for i, (t, k, p) in enumerate(settings)
    ]
    outs, stats = await _run(tiny_checkpoint, reqs, NGRAM)
    assert stats["accepted"] > 0
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
    for r, o in zip(reqs, outs, strict=True):
        assert len(o.output_ids) == 30
        ref = _reference(model, r.input_ids, o.output_ids, r.sampling.temperature)
        assert torch.allclose(torch.tensor(o.output_logprobs), ref, atol=1e-4)


async def test_seeded_request_is_reproducible_alone_and_in_a_crowd(tiny_checkpoint):
    prompt = [1] + [4 + j % 5 for j in range(15)]
    mine = GenerateRequest(prompt, SamplingParams(40, 1.0, 0.95, -1, ignore_eos=True, sampling_seed=123))
    others = [GenerateRequest(prompt[: 6 + i], SamplingParams(20 + i, 1.0, ignore_eos=True)) for i in range(7)]
    alone, _ = await _run(tiny_checkpoint, [mine], NGRAM)
    crowd, _ = await _run(tiny_checkpoint, [*others[:3], mine, *others[3:]], NGRAM)
    again, _ = await _run(tiny_checkpoint, [mine], NGRAM)
    assert alone[0].output_ids == crowd[3].output_ids == again[0].output_ids


async def test_engine_samples_follow_the_filtered_target(tiny_checkpoint):
    """The prompt is every token, then the model's own greedy continuation (so a lookup proposes
    likely tokens): every first token occurs in it, so the second is always drawn by
    verification; its distribution given the first is the target's filtered softmax there."""
    from test_speculative_verify import chi_square_z, target
    from transformers import AutoModelForCausalLM

    from verst.rollout.engines.embedded.sampling import RowSampling

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
    vocab = model.config.vocab_size
    start = [1, *range(4, vocab)]
    greedy, _ = await _run(tiny_checkpoint, [GenerateRequest(start, SamplingParams(60, 0.0, ignore_eos=True))])
    prompt = [*start, *greedy[0].output_ids]
    t, top_k, top_p = 0.1, 12, 0.95  # peaked enough that proposals are often kept (and often not)
    n = 2400
    reqs = [GenerateRequest(prompt, SamplingParams(3, t, top_p, top_k, ignore_eos=True)) for _ in range(n)]
    outs, stats = await _run(tiny_checkpoint, reqs, {"type": "ngram", "num_tokens": 1, "min_ngram": 1, "gate": "off"}, max_batch_size=600)
    assert stats["rows"] >= 0.9 * n and stats["accepted"] > 0.1 * stats["rows"]
    pairs = torch.tensor([o.output_ids[:2] for o in outs])  # [n, 2]
    counts, probs = [], []
    for first in torch.bincount(pairs[:, 0]).nonzero()[:, 0].tolist():  # per first token: its seconds
        seconds = pairs[pairs[:, 0] == first, 1]
        if len(seconds) < 100:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([[*prompt, first]])).logits[0, -1].float()
        counts.append(torch.bincount(seconds, minlength=vocab))
        probs.append(target(logits, RowSampling(t, top_p, top_k)) * len(seconds))
    total = torch.cat(counts)
    assert total.sum() > 1000
    assert chi_square_z(total, torch.cat(probs) / total.sum()) < 4.5


async def test_stops_budgets_and_prefix_shared_groups(tiny_checkpoint):
    prompt = [1] + [4 + j % 4 for j in range(12)]
    reqs = [GenerateRequest(prompt, SamplingParams(9 + i, 0.0, ignore_eos=True)) for i in range(6)]
    reqs.append(GenerateRequest(prompt, SamplingParams(30, 0.0, stop_token_ids=[6], ignore_eos=True)))
    plain, _ = await _run(tiny_checkpoint, reqs)
    spec, _ = await _run(tiny_checkpoint, reqs, NGRAM)
    assert [o.output_ids for o in spec] == [o.output_ids for o in plain]
    assert [len(o.output_ids) for o in spec[:6]] == [9 + i for i in range(6)]
    assert [o.finish_reason for o in spec] == [o.finish_reason for o in plain]


async def test_abort_mid_generation_and_refit_mid_generation(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    engine = EmbeddedEngine.from_pretrained(tiny_checkpoint, speculative=NGRAM)
    try:
        prompt = [1] + [4 + j % 3 for j in range(10)]
        # the refit's tensors are ready before generation starts: a copy loop speculates so fast
        # that loading them mid-generation let a row reach its 4,000 tokens on a quiet box
        fresh = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
        state = {k: v * 0.5 for k, v in fresh.state_dict().items() if k.endswith("mlp.up_proj.weight")}
        long = [GenerateRequest(prompt, SamplingParams(4000, 0.0, ignore_eos=True), rid=f"x{i}") for i in range(3)]
        tasks = [asyncio.ensure_future(engine.generate(r)) for r in long]
        await asyncio.sleep(0.1)
        assert await engine.update_weights_from_tensors(state) == 1  # a refit between steps
        await engine.abort("x")
        outs = await asyncio.gather(*tasks)
        assert all(o.finish_reason == "abort" and 0 < len(o.output_ids) < 4000 for o in outs)
        after = await engine.generate(GenerateRequest(prompt, SamplingParams(16, 0.0, ignore_eos=True)))
    finally:
        await engine.close()
    plain = EmbeddedEngine.from_pretrained(tiny_checkpoint)
    try:
        await plain.update_weights_from_tensors(state)
        ref = await plain.generate(GenerateRequest(prompt, SamplingParams(16, 0.0, ignore_eos=True)))
    finally:
        await plain.close()
    assert after.output_ids == ref.output_ids and after.weight_version == 1


async def test_lora_adapters_greedy_identical(tiny_checkpoint, tmp_path):
    from test_engine_lora import _peft

    _peft(tiny_checkpoint, 1, 4, ["q_proj", "v_proj"]).save_pretrained(tmp_path / "a")
    prompt = [1] + [4 + j % 5 for j in range(12)]
    reqs = [GenerateRequest(prompt, SamplingParams(20, 0.0, ignore_eos=True), lora_path=n) for n in ("a", None, "a")]
    results = []
    for spec in (None, NGRAM):
        engine = EmbeddedEngine.from_pretrained(tiny_checkpoint, speculative=spec, batch_wait_s=0.05)
        try:
            await engine.load_lora_adapter("a", str(tmp_path / "a"))
            results.append([o.output_ids for o in await asyncio.gather(*(engine.generate(r) for r in reqs))])
        finally:
            await engine.close()
    assert results[0] == results[1] and results[0][0] != results[0][1]


async def test_moe_routing_is_recorded_for_accepted_tokens_only(tmp_path):
    from test_engine_moe_routing import _free_routing
    from transformers import AutoModelForCausalLM

    from verst.rollout.toy_moe import make_tiny_moe_checkpoint

    moe = make_tiny_moe_checkpoint(tmp_path / "m", family="qwen3_moe", num_layers=2)
    prompt = [5, 9, 14, 7, 11, 5, 9, 14, 7, 11, 5, 9]
    reqs = [
        GenerateRequest(prompt, SamplingParams(14, 0.0, ignore_eos=True), return_routed_experts=True),
        GenerateRequest(prompt[:7], SamplingParams(10, 1.0, sampling_seed=3, ignore_eos=True), return_routed_experts=True),
    ]
    outs, stats = await _run(moe, reqs, NGRAM)
    assert stats["steps"] > 0
    model = AutoModelForCausalLM.from_pretrained(moe).eval()
    for r, o in zip(reqs, outs, strict=True):
        got = o.routed_experts.to_tensor().reshape(len(r.input_ids) + len(o.output_ids) - 1, -1)
        assert torch.equal(got.long(), _free_routing(model, r.input_ids + o.output_ids).long())


async def test_draft_model_greedy_identical_and_refit_with_policy(tiny_checkpoint, tmp_path):
    from verst.rollout.toy import make_tiny_checkpoint

    draft = make_tiny_checkpoint(tmp_path / "draft", seed=1, num_layers=1)
    cfg = {"type": "draft_model", "model_path": str(draft), "num_tokens": 3, "refit": "with_policy", "gate": "off"}
    prompt = [1] + [4 + j % 7 for j in range(12)]
    reqs = [GenerateRequest(prompt[: 6 + i], SamplingParams(16, 0.0, ignore_eos=True)) for i in range(4)]
    plain, _ = await _run(tiny_checkpoint, reqs)
    engine = EmbeddedEngine.from_pretrained(tiny_checkpoint, speculative=cfg, batch_wait_s=0.05)
    try:
        spec = await asyncio.gather(*(engine.generate(r) for r in reqs))
        assert engine.speculative_stats["proposed"] > 0
        proposer = engine._batch.speculative.proposer
        name = "model.embed_tokens.weight"
        new = torch.randn_like(proposer.model.state_dict()[name])
        await engine.update_weights_from_tensors({name: new})
        assert torch.equal(proposer.model.state_dict()[name], new)  # the draft followed the policy
    finally:
        await engine.close()
    assert [o.output_ids for o in spec] == [o.output_ids for o in plain]


def test_config_table_and_problems():
    from verst.rollout.engines.config import parse_engine_config

    c = parse_engine_config({"speculative": {"type": "ngram", "num_tokens": 3}})
    assert c.speculative.type == "ngram" and c.speculative.num_tokens == 3
    assert parse_engine_config({}).speculative.enabled is False
    bad = parse_engine_config({"model_path": "m", "speculative": {"type": "draft_model"}})
    assert [p.key for p in bad.problems("engine")] == ["engine.speculative.model_path"]
    with pytest.raises(ValueError, match="speculative proposer type"):
        parse_engine_config({"speculative": {"type": "medusa"}})
    assert parse_speculative('{"type": "ngram"}').type == "ngram"


async def test_verst_serve_speculates_and_reports_its_counters(tiny_checkpoint):
    import aiohttp
    from serve_testlib import serve_app

    from verst.rollout.engines.serve.server import build_app, make_parser
    from verst.rollout.engines.sglang.client import SGLangClient

    args = make_parser().parse_args(["--model", str(tiny_checkpoint), "--speculative", json.dumps(NGRAM)])
    prompt = [1] + [4 + j % 4 for j in range(12)]
    req = GenerateRequest(prompt, SamplingParams(20, 0.0, ignore_eos=True))
    plain, _ = await _run(tiny_checkpoint, [req])
    engine = EmbeddedEngine.from_pretrained(tiny_checkpoint, speculative=args.speculative)
    async with serve_app(build_app(engine)) as url:
        client = SGLangClient(url)
        try:
            out = await client.generate(req)
        finally:
            await client.close()
        async with aiohttp.ClientSession() as http, http.get(f"{url}/server_info") as resp:
            info = await resp.json()
    await engine.close()
    assert out.output_ids == plain[0].output_ids
    assert info["speculative"]["accepted"] > 0
