"""Prefix sharing in the embedded engine's prefill: rows of one admission with the same prompt
and adapter (a GRPO group's n samples) are prefilled once and the result is copied to each.

Pinned here: the prefill forward carries only the distinct prompts; every row's tokens (seeded
sampling and greedy), log-probs and prompt scores equal the unshared path's; shared rows get
their own cache storage (they decode apart, each as it would alone) with the spare-capacity
buffer intact; the engine counts the prompt tokens it saved.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded.batch import DecodeBatch, Row, share_groups
from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.engines.embedded.sampling import RowSampling

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()


def prompt_ids(kind: int, length: int) -> list[int]:
    return [1] + [4 + (kind * 11 + j * 3) % 50 for j in range(length - 1)]


def make_row(
    ids: list[int],
    *,
    max_new: int,
    temperature: float = 1.0,
    seed: int | None = None,
    logprobs: bool = False,
) -> Row:
    req = GenerateRequest(
        list(ids),
        SamplingParams(max_new, temperature=temperature, ignore_eos=True, sampling_seed=seed),
        return_logprob=logprobs,
        logprob_start_len=0 if logprobs else -1,
        top_logprobs_num=3 if logprobs else 0,
        token_ids_logprob=[5, 9] if logprobs else None,
        rid=str(seed),
    )
    return Row(req, RowSampling(temperature, 1.0, -1, seed), frozenset(), 256)


def decode(model, rows: list[Row], *, share: bool) -> list[int]:
    """Admit `rows` in one prefill and decode them to the end; returns the prefill's batch sizes."""
    batch = DecodeBatch(model, 0, None)
    batch.share_prefix = share
    sizes: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, args, kwargs: sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        with torch.inference_mode():
            batch.admit(rows)
            batch.pop_finished()
            while len(batch):
                batch.step()
                batch.pop_finished()
    finally:
        hook.remove()
    return sizes[:1]


def assert_same(shared: list[Row], plain: list[Row]) -> None:
    for a, b in zip(shared, plain, strict=True):
        assert a.output_ids == b.output_ids, (a.request.rid, a.output_ids, b.output_ids)
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)
        assert a.finish == b.finish == "length"
        if b.input_logprobs is None:
            assert a.input_logprobs is None
            continue
        assert a.input_logprobs[0] is None and a.input_logprobs[1:] == pytest.approx(
            b.input_logprobs[1:], abs=1e-5
        )
        assert [[t for _, t in p] for p in a.input_top[1:]] == [[t for _, t in p] for p in b.input_top[1:]]
        assert [v for p in a.input_ids_lp[1:] for v, _ in p] == pytest.approx(
            [v for p in b.input_ids_lp[1:] for v, _ in p], abs=1e-5
        )


GROUPS = [  # (prompt kind, prompt length, temperature, seed, max new, prompt logprobs)
    (0, 9, 1.0, 10, 6, False),
    (0, 9, 1.0, 11, 4, False),
    (1, 5, 0.0, None, 5, True),
    (0, 9, 0.7, 12, 7, True),
    (2, 13, 1.0, 13, 3, False),
    (1, 5, 1.3, 14, 6, True),
    (0, 9, 0.0, None, 6, False),
    (1, 5, 1.3, 15, 2, True),
]


def build(specs) -> list[Row]:
    return [
        make_row(prompt_ids(k, n), max_new=m, temperature=t, seed=s, logprobs=lp)
        for k, n, t, s, m, lp in specs
    ]


def test_mixed_groups_prefill_once_and_match_the_unshared_path(model):
    shared, plain = build(GROUPS), build(GROUPS)
    assert decode(model, shared, share=True) == [3]  # three distinct prompts, one row each
    assert decode(model, plain, share=False) == [len(GROUPS)]
    assert_same(shared, plain)
    # identical prompts, different seeds: the copies decode apart (no shared storage)
    assert shared[0].output_ids[:4] != shared[1].output_ids


def test_shared_rows_decode_as_they_would_alone(model):
    rows = [make_row(prompt_ids(3, 8), max_new=8, seed=s) for s in range(4)]
    decode(model, rows, share=True)
    for r in rows:
        alone = make_row(prompt_ids(3, 8), max_new=8, seed=int(r.request.rid))
        decode(model, [alone], share=True)
        assert alone.output_ids == r.output_ids
    assert len({tuple(r.output_ids) for r in rows}) > 1


def test_shared_cache_has_own_storage_and_spare_room(model):
    rows = [make_row(prompt_ids(0, 6), max_new=4 + i, seed=i) for i in range(3)]
    rows.insert(1, make_row(prompt_ids(1, 4), max_new=2, seed=9))
    batch = DecodeBatch(model, 0, None)
    batch.share_decode = False  # the flat layout: each row its own copy of its prompt's KV
    with torch.inference_mode():
        batch.admit(rows)
        assert batch.prefill_tokens == 6 + 4 and batch.prefill_tokens_saved == 12
        layer = batch.cache.layers[0]
        assert layer._kbuf.shape[:3] == (4, layer.keys.shape[1], 6 + 6)  # width + longest budget
        assert layer._start() == 0  # still views of the grown buffer
        before = layer.keys[2].clone()
        layer.keys[0].add_(1.0)  # a write into row 0's copy leaves row 2's alone
        assert torch.equal(layer.keys[2], before)
        assert batch.mask.tolist()[:2] == [[1] * 6, [0, 0, 1, 1, 1, 1]]
        assert batch.next_pos.tolist() == [6, 4, 6, 6]


def test_adapter_is_part_of_the_key():
    def row(ids, lora):
        r = make_row(ids, max_new=1)
        r.request = GenerateRequest(r.request.input_ids, r.request.sampling, lora_path=lora)
        return r

    a, b = [1, 5, 6], [1, 5, 7]
    rows = [row(a, None), row(a, "x"), row(b, None), row(a, None), row(a, "x"), row(a, "y")]
    assert share_groups(rows) == ([0, 1, 2, 5], [0, 1, 2, 0, 1, 3])


@settings(max_examples=12, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2),  # prompt kind
            st.sampled_from([0.0, 0.8, 1.0]),  # temperature
            st.integers(1, 5),  # max new tokens
            st.booleans(),  # prompt logprobs
        ),
        min_size=1,
        max_size=8,
    ),
    st.lists(st.integers(2, 12), min_size=3, max_size=3),  # prompt length per kind
)
def test_random_groupings_match_the_unshared_path(model, specs, lengths):
    full = [(k, lengths[k], t, i, m, lp) for i, (k, t, m, lp) in enumerate(specs)]
    shared, plain = build(full), build(full)
    assert decode(model, shared, share=True) == [len({k for k, *_ in specs})]
    decode(model, plain, share=False)
    assert_same(shared, plain)


async def test_engine_groups_share_prefill_and_count_saved_tokens(tiny_checkpoint):
    groups = [prompt_ids(k, 6 + 3 * k) for k in range(3)]
    reqs = [
        GenerateRequest(p, SamplingParams(6, temperature=1.0, sampling_seed=10 * g + i, ignore_eos=True))
        for g, p in enumerate(groups)
        for i in range(4)
    ]
    outs = {}
    for share in (True, False):
        engine = EmbeddedEngine.from_pretrained(tiny_checkpoint, batch_wait_s=0.05, prefix_sharing=share)
        try:
            outs[share] = await asyncio.gather(*(engine.generate(r) for r in reqs))
            stats = engine.prefill_stats
        finally:
            await engine.close()
        saved = sum(3 * len(p) for p in groups) if share else 0
        assert stats == {"rows": 12, "tokens": sum(4 * len(p) for p in groups) - saved, "saved": saved}
    assert [o.output_ids for o in outs[True]] == [o.output_ids for o in outs[False]]


async def test_engine_config_switches_prefix_sharing(tiny_checkpoint):
    from verst.rollout.engines.config import EmbeddedEngineConfig

    req = GenerateRequest(prompt_ids(1, 9), SamplingParams(3, temperature=1.0, ignore_eos=True))
    saved = {}
    for share in (True, False):
        cfg = EmbeddedEngineConfig(model_path=str(tiny_checkpoint), device="cpu", prefix_sharing=share)
        engine = await cfg.build(max_concurrency=8)
        try:
            await asyncio.gather(*(engine.generate(req) for _ in range(8)))
            saved[share] = engine.prefill_stats["saved"]
        finally:
            await engine.close()
    assert saved[True] > 0 and saved[False] == 0
