"""The embedded engine on the tiny model: batching, sampling semantics, log-probs, abort, weights."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.common.errors import InvalidRequest
from verst.rollout.engines.embedded.engine import EmbeddedEngine

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    eng = EmbeddedEngine.from_pretrained(tiny_checkpoint)
    yield eng
    asyncio.run(eng.close())


def prompt(i: int, n: int = 5) -> list[int]:
    return [1] + [4 + (i * 7 + j) % 50 for j in range(n + i % 6)]


def reference_logprobs(model, ids: list[int], out: list[int], temperature: float) -> torch.Tensor:
    """What the trainer computes: one full forward, log_softmax(logits / T) of the sampled tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + out])).logits[0].float()  # [seq, vocab]
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / t, dim=-1)[len(ids) - 1 : -1]  # [out, vocab]
    return lp.gather(-1, torch.tensor(out)[:, None])[:, 0]


async def test_many_concurrent_requests_are_batched(engine):
    reqs = [
        GenerateRequest(prompt(i), SamplingParams(max_new_tokens=4 + i % 9, temperature=0.8, ignore_eos=True))
        for i in range(24)
    ]
    outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
    assert [len(o.output_ids) for o in outs] == [4 + i % 9 for i in range(24)]
    assert all(
        o.finish_reason == "length" and o.prompt_tokens == len(r.input_ids)
        for o, r in zip(outs, reqs, strict=True)
    )
    assert engine.peak_batch > 1


async def test_logprobs_match_full_forward_with_padding_and_late_joiners(engine):
    """Rows of different prompt lengths, different temperatures/top-k/top-p, some joining mid-decode."""
    settings = [(1.0, -1, 1.0), (0.7, 5, 1.0), (0.0, -1, 1.0), (1.3, -1, 0.8), (0.5, 3, 0.9)]
    reqs = [
        GenerateRequest(prompt(i, 3 + 2 * i), SamplingParams(24, t, p, k, ignore_eos=True, sampling_seed=i))
        for i, (t, k, p) in enumerate(settings)
    ]
    first = [asyncio.ensure_future(engine.generate(r)) for r in reqs[:2]]
    await asyncio.sleep(0.02)
    outs = await asyncio.gather(*first, *(engine.generate(r) for r in reqs[2:]))
    for req, out in zip(reqs, outs, strict=True):
        ref = reference_logprobs(engine.model, req.input_ids, out.output_ids, req.sampling.temperature)
        err = (ref - torch.tensor(out.output_logprobs)).abs().max().item()
        assert err < 1e-4, (req.sampling, err)


async def test_greedy_matches_hf_generate(engine):
    ids = prompt(3, 8)
    out = await engine.generate(GenerateRequest(ids, SamplingParams(12, temperature=0.0, ignore_eos=True)))
    with torch.no_grad():
        hf = engine.model.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, min_new_tokens=12
        )
    assert out.output_ids == hf[0, len(ids) :].tolist()


async def test_seeded_sampling_is_independent_of_batch_composition(engine):
    target = GenerateRequest(
        prompt(2), SamplingParams(16, temperature=1.0, ignore_eos=True, sampling_seed=1234)
    )
    alone = await engine.generate(target)
    others = [
        GenerateRequest(
            prompt(i, 2 + i), SamplingParams(8 + i, temperature=0.9, ignore_eos=True, sampling_seed=i)
        )
        for i in range(7)
    ]
    crowd = await asyncio.gather(
        *(engine.generate(r) for r in others[:3]),
        engine.generate(target),
        *(engine.generate(r) for r in others[3:]),
    )
    assert crowd[3].output_ids == alone.output_ids
    unseeded = await asyncio.gather(
        *(engine.generate(GenerateRequest(prompt(2), SamplingParams(16, ignore_eos=True))) for _ in range(2))
    )
    assert unseeded[0].output_ids != unseeded[1].output_ids  # no hidden fixed seed


async def test_stop_token_ids_stop_strings_and_eos(engine):
    ids = prompt(4, 6)
    base = await engine.generate(GenerateRequest(ids, SamplingParams(20, temperature=0.0, ignore_eos=True)))
    stop_tok = base.output_ids[5]
    k = base.output_ids.index(stop_tok)
    out = await engine.generate(
        GenerateRequest(ids, SamplingParams(20, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_tok,)))
    )
    assert out.output_ids == base.output_ids[: k + 1] and out.finish_reason == "stop"
    text = engine.tokenizer.decode(base.output_ids, skip_special_tokens=False)
    needle = engine.tokenizer.decode(base.output_ids[6:8], skip_special_tokens=False)
    out = await engine.generate(
        GenerateRequest(ids, SamplingParams(20, temperature=0.0, stop=(needle,), ignore_eos=True))
    )
    assert out.finish_reason == "stop" and out.text.endswith(needle) and text.startswith(out.text)
    assert needle not in out.text[:-1]
    # EOS stops unless ignore_eos: make EOS the greedy pick by declaring the first greedy token EOS.
    first = base.output_ids[0]
    out = await engine.generate(
        GenerateRequest(ids, SamplingParams(20, temperature=0.0, stop_token_ids=(first,)))
    )
    assert out.output_ids == [first] and out.finish_reason == "stop"


async def test_max_new_tokens_and_context_limit(engine):
    out = await engine.generate(GenerateRequest(prompt(1), SamplingParams(5, ignore_eos=True)))
    assert len(out.output_ids) == 5 and out.finish_reason == "length"
    ctx = engine.context_len
    long = [1] + [5] * (ctx - 4)  # 3 positions left
    out = await engine.generate(GenerateRequest(long, SamplingParams(50, ignore_eos=True)))
    assert len(out.output_ids) == 3 and out.finish_reason == "length"
    with pytest.raises(InvalidRequest, match="context length"):
        await engine.generate(GenerateRequest([1] * (ctx + 1), SamplingParams(5)))
    with pytest.raises(InvalidRequest, match="top_p"):
        await engine.generate(GenerateRequest([1, 2], SamplingParams(5, top_p=0.0)))


async def test_abort_by_prefix_then_all_returns_partial_output(engine):
    long = SamplingParams(200, temperature=1.0, ignore_eos=True)
    reqs = [GenerateRequest(prompt(i), long, rid=f"{'a' if i < 2 else 'b'}-{i}") for i in range(4)]
    tasks = [asyncio.ensure_future(engine.generate(r)) for r in reqs]
    while engine.load()["num_running_reqs"] < 4:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)
    await engine.abort("a-")
    done_a = await asyncio.wait_for(asyncio.gather(*tasks[:2]), 10)
    assert all(o.finish_reason == "abort" and 0 < len(o.output_ids) < 200 for o in done_a)
    assert all(len(o.output_logprobs) == len(o.output_ids) for o in done_a)
    assert not any(t.done() for t in tasks[2:])
    await engine.abort()
    done_b = await asyncio.wait_for(asyncio.gather(*tasks[2:]), 10)
    assert all(o.finish_reason == "abort" and len(o.output_ids) < 200 for o in done_b)


async def test_abort_of_queued_request_and_pause(engine):
    engine.pause()
    try:
        task = asyncio.ensure_future(
            engine.generate(GenerateRequest(prompt(1), SamplingParams(5), rid="queued-1"))
        )
        await asyncio.sleep(0.05)
        assert not task.done()  # paused: waits
        await engine.abort("queued")
        out = await asyncio.wait_for(task, 5)
        assert out.finish_reason == "abort" and out.output_ids == []
        assert engine.flush_cache()
    finally:
        engine.resume()
    out = await engine.generate(GenerateRequest(prompt(1), SamplingParams(3, ignore_eos=True)))
    assert len(out.output_ids) == 3


async def test_scoring_prompt_logprobs_topk_and_token_ids(engine):
    ids = prompt(5, 12)
    req = GenerateRequest(
        ids, SamplingParams(0), logprob_start_len=0, top_logprobs_num=3, token_ids_logprob=[5, 9]
    )
    out = await engine.generate(req)
    assert out.output_ids == [] and out.input_logprobs is not None and out.input_logprobs[0] is None
    with torch.no_grad():
        lp = torch.log_softmax(engine.model(torch.tensor([ids])).logits[0].float(), -1)[:-1]  # [seq-1, vocab]
    ref = lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert (torch.tensor(out.input_logprobs[1:]) - ref).abs().max() < 1e-4
    assert out.input_top_logprobs[0] is None and len(out.input_top_logprobs) == len(ids)
    top = torch.topk(lp, 3, dim=-1)
    assert [t for _, t in out.input_top_logprobs[4]] == top.indices[3].tolist()
    assert out.input_token_ids_logprobs[2][1] == pytest.approx((lp[1, 9].item(), 9), abs=1e-4)
    # generation with the same extras: output positions too, and prompt scores from the batched prefill
    gen = await engine.generate(
        GenerateRequest(
            ids,
            SamplingParams(4, temperature=0.0, ignore_eos=True),
            logprob_start_len=0,
            top_logprobs_num=2,
            token_ids_logprob=[5],
        )
    )
    assert len(gen.output_top_logprobs) == 4 and len(gen.output_token_ids_logprobs) == 4
    assert gen.output_top_logprobs[0][0][1] == gen.output_ids[0]  # greedy picks the top-1
    assert (torch.tensor(gen.input_logprobs[1:]) - ref).abs().max() < 1e-4


async def test_weight_updates_in_process_and_from_disk(tiny_checkpoint, tmp_path):
    eng = EmbeddedEngine.from_pretrained(tiny_checkpoint)
    try:
        req = GenerateRequest(prompt(0), SamplingParams(8, temperature=0.0, ignore_eos=True))
        before = await eng.generate(req)
        assert before.weight_version == 0
        state = {k: v.clone() for k, v in eng.model.state_dict().items()}
        bumped = {"lm_head.weight": state["lm_head.weight"] * 3.0}
        assert await eng.update_weights_from_tensors(bumped) == 1
        after = await eng.generate(req)
        assert after.weight_version == 1 and after.output_logprobs != before.output_logprobs
        ref = reference_logprobs(eng.model, req.input_ids, after.output_ids, 0.0)
        assert (ref - torch.tensor(after.output_logprobs)).abs().max() < 1e-4
        with pytest.raises(InvalidRequest, match="unknown names"):
            await eng.update_weights_from_tensors({"nope.weight": torch.zeros(1)})
        assert await eng.update_weights_from_disk(str(tiny_checkpoint), weight_version=7) == 7
        again = await eng.generate(req)
        assert again.weight_version == 7 and again.output_ids == before.output_ids
        assert again.output_logprobs == pytest.approx(before.output_logprobs, abs=1e-6)
        with pytest.raises(InvalidRequest):
            await eng.update_weights_from_disk(str(tmp_path / "missing"))
    finally:
        await eng.close()


async def test_weight_update_lands_between_decode_steps(tiny_checkpoint):
    eng = EmbeddedEngine.from_pretrained(tiny_checkpoint)
    try:
        task = asyncio.ensure_future(
            eng.generate(GenerateRequest(prompt(0), SamplingParams(150, ignore_eos=True)))
        )
        while eng.load()["num_running_reqs"] == 0:
            await asyncio.sleep(0.005)
        version = await eng.update_weights_from_tensors({"lm_head.weight": eng.model.lm_head.weight * 1.0})
        out = await task
        assert version == 1 and out.weight_version == 1 and len(out.output_ids) == 150
    finally:
        await eng.close()
    with pytest.raises(Exception, match="closed"):
        await eng.generate(GenerateRequest([1, 2], SamplingParams(2)))


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.sampled_from([0.0, 0.5, 1.0, 1.7]),
            st.sampled_from([-1, 1, 3, 10]),
            st.sampled_from([1.0, 0.9, 0.3, 0.01]),
            st.one_of(st.none(), st.integers(0, 2**31)),
        ),
        min_size=1,
        max_size=6,
    ),
    seed=st.integers(0, 1000),
)
def test_sampling_respects_topk_topp_and_reports_untruncated_logprobs(rows, seed):
    from verst.rollout.engines.embedded.sampling import BatchSampling, RowSampling, sample

    vocab = 16
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * 3  # [rows, vocab]
    specs = [RowSampling(t, p, k, s) for t, k, p, s in rows]
    tokens, lps = sample(logits, BatchSampling.build(specs, vocab, "cpu"), torch.arange(len(rows)))
    for i, (t, k, p, _) in enumerate(rows):
        expected = torch.log_softmax(logits[i] / (t if t > 0 else 1.0), -1)
        assert torch.allclose(lps.rows(i), expected, atol=1e-5)
        assert torch.allclose(lps.of(tokens)[i], expected[tokens[i]], atol=1e-5)
        order = torch.argsort(expected, descending=True).tolist()
        if t == 0:
            assert tokens[i] == order[0]
            continue
        rank = order.index(int(tokens[i]))
        probs = expected.exp()[order]
        allowed = int((torch.cumsum(probs, 0) - probs < p).sum())  # smallest prefix reaching p
        assert rank < max(1, allowed) and (k == -1 or rank < k)
