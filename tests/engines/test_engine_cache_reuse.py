"""The decode batch's KV cache: rows leaving and joining reuse the grown buffer, results unchanged.

Rows of different prompt lengths and output budgets finish at different steps (the batch drops
them and trims all-padding columns) while others join mid-decode; every row's tokens must equal
its tokens decoded alone (seeded sampling) and its log-probs a full forward pass, and the cache
must be copied into a fresh buffer only at prefill and merge — not after every finished row.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded import kv_cache as _kv_cache
from verst.rollout.engines.embedded.batch import DecodeBatch, Row
from verst.rollout.engines.embedded.sampling import RowSampling

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()


def make_row(prompt_len: int, max_new: int, seed: int) -> Row:
    ids = [1] + [4 + (seed * 5 + j) % 50 for j in range(prompt_len - 1)]
    req = GenerateRequest(ids, SamplingParams(max_new, temperature=1.0, ignore_eos=True), rid=str(seed))
    return Row(req, RowSampling(1.0, 1.0, -1, seed), frozenset(), 256)


def decode(model, waves: list[list[Row]], join_after: int = 2) -> list[Row]:
    """Admit `waves[0]`, then each further wave after `join_after` more steps; run to the end."""
    batch = DecodeBatch(model, 0, None)
    done: list[Row] = []
    pending = list(waves)
    steps = 0
    with torch.inference_mode():
        while pending or len(batch):
            if pending and (not len(batch) or steps % join_after == 0):
                batch.admit(pending.pop(0))
            done += batch.pop_finished()
            if len(batch):
                batch.step()
                steps += 1
            done += batch.pop_finished()
    return done


def full_forward_logprobs(model, row: Row) -> torch.Tensor:
    ids = list(row.request.input_ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids + row.output_ids])).logits[0]  # [seq, vocab]
    lp = torch.log_softmax(logits.float(), dim=-1)[len(ids) - 1 : -1]  # [out, vocab]
    return lp.gather(-1, torch.tensor(row.output_ids)[:, None])[:, 0]


@settings(max_examples=6, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(2, 14), st.integers(1, 9)),  # (prompt length, max new tokens)
        min_size=2,
        max_size=7,
    ),
    st.integers(1, 3),
)
def test_rows_leaving_and_joining_keep_tokens_and_logprobs(model, specs, join_after):
    half = max(1, len(specs) // 2)
    rows = [make_row(p, n, i) for i, (p, n) in enumerate(specs)]
    done = decode(model, [rows[:half], rows[half:]], join_after)
    assert sorted(r.request.rid for r in done) == sorted(r.request.rid for r in rows)
    for r, (_, n) in zip(rows, specs, strict=True):
        assert len(r.output_ids) == n and r.finish == "length"
        alone = decode(model, [[make_row(len(r.request.input_ids), n, int(r.request.rid))]])[0]
        assert alone.output_ids == r.output_ids  # seeded: independent of the batch around it
        err = (full_forward_logprobs(model, r) - torch.tensor(r.output_logprobs)).abs().max().item()
        assert err < 1e-4


def test_finished_rows_do_not_reallocate_the_cache(model, monkeypatch):
    """Rows finishing one by one (and leading pad columns trimmed) reuse the buffer: the only
    copies into a fresh buffer are the prefill's, one per layer."""
    adopted: list[tuple[int, ...]] = []
    layer_cls = _kv_cache._growing_layer_class()
    original = layer_cls._adopt

    def counting(self, keys, values, extra):
        adopted.append(tuple(keys.shape))
        original(self, keys, values, extra)

    monkeypatch.setattr(layer_cls, "_adopt", counting)
    # the longest prompt finishes first, so its padding columns are trimmed from the others
    rows = [make_row(12, 1, 0)] + [make_row(3 + i, 2 + i, i + 1) for i in range(6)]
    done = decode(model, [rows])
    layers = model.config.num_hidden_layers
    assert len(done) == 7 and [len(r.output_ids) for r in rows] == [1, 2, 3, 4, 5, 6, 7]
    assert len(adopted) == layers, adopted
    assert all(shape[0] == 7 for shape in adopted)  # prefill only


def test_spare_capacity_follows_the_rows_budget(model):
    rows = [make_row(4, 3, 0), make_row(5, 5, 1)]
    batch = DecodeBatch(model, 0, None)
    with torch.inference_mode():
        batch.admit(rows)
        layer = batch.cache.layers[0]
        assert layer._kbuf.shape[2] == 5 + 5  # prompt width + the longest budget, not +CHUNK
        for _ in range(3):  # row 0 finishes after 2 steps and leaves; row 1 keeps decoding
            batch.step()
            batch.pop_finished()
        assert len(batch) == 1 and len(rows[1].output_ids) == 4
        assert batch.cache.layers[0]._start() is not None  # still views of the grown buffer


def test_finished_rows_are_compacted_in_bulk(model, monkeypatch):
    """A finished row's slot lingers (decoded, ignored) until a quarter of the slots are dead:
    one cache copy then serves several departures; the others' tokens are unchanged."""
    layer_cls = _kv_cache._growing_layer_class()
    original = layer_cls.batch_select_indices
    kept: list[int] = []

    def counting(self, indices):
        kept.append(len(indices))
        original(self, indices)

    monkeypatch.setattr(layer_cls, "batch_select_indices", counting)
    rows = [make_row(4 + i % 3, 1 + i, i) for i in range(8)]  # one leaves per step
    decode(model, [rows])
    assert kept[:: model.config.num_hidden_layers] == [6, 4, 3, 2, 1]  # 5 copies for 7 departures
    for r in rows:
        alone = decode(model, [[make_row(len(r.request.input_ids), len(r.output_ids), int(r.request.rid))]])[
            0
        ]
        assert alone.output_ids == r.output_ids


def test_growing_layer_appends_after_trims_and_replacements():
    """A cache layer reuses the view start it remembers only while its keys, values and buffers
    are the objects it left: after a trim (a narrower view of the buffer), a replacement (a
    concatenation, as a merge does) and a row selection, every update still appends after the
    current columns — the layer always equals plain concatenation."""
    layer = _kv_cache._growing_layer_class()()
    g = torch.Generator().manual_seed(0)

    def new(width: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(3, 2, width, 4, generator=g), torch.randn(3, 2, width, 4, generator=g)

    want_k, want_v = new(5)
    layer.update(want_k, want_v)
    for change in ("none", "trim", "replace", "none", "select", "none"):
        if change == "trim":
            layer.keys, layer.values = layer.keys[:, :, 2:], layer.values[:, :, 2:]
            want_k, want_v = want_k[:, :, 2:], want_v[:, :, 2:]
        elif change == "replace":
            pad_k, pad_v = new(1)
            layer.keys, layer.values = torch.cat([pad_k, layer.keys], 2), torch.cat([pad_v, layer.values], 2)
            want_k, want_v = torch.cat([pad_k, want_k], 2), torch.cat([pad_v, want_v], 2)
        elif change == "select":
            index = torch.tensor([2, 0])
            layer.batch_select_indices(index)
            want_k, want_v = want_k[index], want_v[index]
        k, v = new(1)
        k, v = k[: want_k.shape[0]], v[: want_k.shape[0]]
        got_k, got_v = layer.update(k, v)
        want_k, want_v = torch.cat([want_k, k], 2), torch.cat([want_v, v], 2)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
