"""Prompts of similar length together (`engines/embedded/ragged.py`): the grouped prefill
(`engines/embedded/prefill.py`).

Pinned here: `split_by_width` finds the cheapest split (against brute force); for every family
the direct decode step serves (and grouped KV heads), a prefill in groups — prompts in any order,
odd lengths — gives each row the logits, cache and MoE routing of one padded forward, in the
rows' own order; a batch that prefills in groups (late joiners, finished rows, shared prompts,
prompt log-probs) gives the tokens and log-probs of one that does not, and both equal a full
forward's log-probs.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded.attention import use_grouped_sdpa
from verst.rollout.engines.embedded.batch import DecodeBatch, Row
from verst.rollout.engines.embedded.direct import FAMILIES
from verst.rollout.engines.embedded.prefill import PrefillModel, prefill
from verst.rollout.engines.embedded.ragged import split_by_width
from verst.rollout.engines.embedded.sampling import RowSampling
from verst.rollout.moe import RouterHooks
from verst.rollout.toy import decoder_fields
from verst.rollout.toy_moe import build_tiny_moe

torch.set_num_threads(1)
VOCAB = 40


def _padding(widths: list[int], bounds: list[tuple[int, int]]) -> int:
    return sum(max(widths[lo:hi]) * (hi - lo) - sum(widths[lo:hi]) for lo, hi in bounds)


def _cheapest(widths: list[int], cost: float) -> float:
    """Brute force over every split of `widths` into contiguous groups."""
    n, best = len(widths), float("inf")
    for cuts in itertools.product((False, True), repeat=n - 1):
        edges = [0, *[i + 1 for i, c in enumerate(cuts) if c], n]
        bounds = list(itertools.pairwise(edges))
        best = min(best, _padding(widths, bounds) + cost * len(bounds))
    return best


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 9), min_size=1, max_size=8),
    st.sampled_from([0.0, 0.5, 2.0, 7.0, 1000.0]),
)
def test_split_by_width_is_the_cheapest_contiguous_split(widths, cost):
    bounds = split_by_width(widths, cost)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(widths)
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(bounds))
    assert _padding(widths, bounds) + cost * len(bounds) == pytest.approx(_cheapest(widths, cost))
    assert all(widths[lo - 1] != widths[lo] for lo, _ in bounds[1:])  # equal neighbours stay together


def test_split_by_width_edges():
    assert split_by_width([], 1.0) == []
    assert split_by_width([5, 5, 5], 0.0) == [(0, 3)]
    assert split_by_width([9, 8, 2, 1], 0.0) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert split_by_width([9, 8, 2, 1], 3.0) == [(0, 2), (2, 4)]
    assert split_by_width([9, 8, 2, 1], 100.0) == [(0, 4)]


def _model(family: str, kv: int = 4):
    import transformers

    if family in ("qwen3_moe", "mixtral"):
        return build_tiny_moe(family, VOCAB, hidden_size=32, num_layers=2, num_heads=4, seed=1).eval()
    fields = {**decoder_fields(VOCAB, hidden_size=32, num_layers=2, num_heads=4), "num_key_value_heads": kv}
    config = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[family](**fields, intermediate_size=48, head_dim=8, sliding_window=None)
    torch.manual_seed(1)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _row(ids: list[int], max_new: int = 4, seed: int = 0, logprobs: bool = False) -> Row:
    req = GenerateRequest(
        ids,
        SamplingParams(max_new, temperature=1.0, ignore_eos=True, sampling_seed=seed),
        return_logprob=logprobs,
        logprob_start_len=0 if logprobs else -1,
        rid=str(seed),
    )
    return Row(req, RowSampling(1.0, 1.0, -1, seed), frozenset(), 256)


def _prompts(lens: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("family", [*sorted(FAMILIES), "llama_gqa"])
def test_grouped_prefill_equals_one_padded_forward(family):
    model = _model("llama", kv=2) if family == "llama_gqa" else _model(family)
    if family == "llama_gqa":
        assert use_grouped_sdpa(model)
    rows = [_row(p) for p in _prompts([6, 1, 11, 3, 10, 6, 7], seed=len(family))]  # any order, odd lengths
    hooks = RouterHooks.of(model)
    m = PrefillModel(model, 0, torch.device("cpu"), None, hooks, lambda rows: None)
    with torch.inference_mode():
        one = prefill(m, rows, 4, True, float("inf"))
        split = prefill(m, rows, 4, True, 0.0)  # a group per distinct length
    assert torch.equal(one.mask, split.mask)
    assert one.mask.sum(1).tolist() == [6, 1, 11, 3, 10, 6, 7]  # the rows' own order
    torch.testing.assert_close(split.last, one.last, rtol=1e-5, atol=1e-5)
    for a, b in zip(split.logits, one.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    attended = one.mask.bool()[:, None, :, None]  # [rows, 1, width, 1]
    for a, b in zip(split.cache.layers, one.cache.layers, strict=True):
        assert a.keys.shape == b.keys.shape and a._start() == 0  # views of a buffer with spare room
        assert a._kbuf.shape[2] == a.keys.shape[2] + 4
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            torch.testing.assert_close(x * attended, y * attended, rtol=1e-5, atol=1e-5)
            assert not (x * ~attended).any()  # padding columns are zeros
    if hooks is not None:
        assert all(torch.equal(a, b) for a, b in zip(split.routing, one.routing, strict=True))
        assert [len(r) for r in split.routing] == [r.prompt_len for r in rows]


@pytest.fixture(scope="module")
def llama():
    return _model("llama")


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(1, 12), min_size=1, max_size=7),
    st.sampled_from([0.0, 2.0, 10.0, 1e9]),
    st.booleans(),
)
def test_grouped_prefill_property(llama, lens, cost, full):
    rows = [_row(p) for p in _prompts(lens, seed=sum(lens))]
    m = PrefillModel(llama, 0, torch.device("cpu"), None, None, lambda rows: None)
    with torch.inference_mode():
        one = prefill(m, rows, 2, full, float("inf"))
        split = prefill(m, rows, 2, full, cost)
    assert torch.equal(one.mask, split.mask) and one.mask.sum(1).tolist() == lens
    torch.testing.assert_close(split.last, one.last, rtol=1e-5, atol=1e-5)
    if full:
        for a, b, n in zip(split.logits, one.logits, lens, strict=True):
            assert a.shape[0] == n
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    attended = one.mask.bool()[:, None, :, None]
    for a, b in zip(split.cache.layers, one.cache.layers, strict=True):
        torch.testing.assert_close(a.keys * attended, b.keys * attended, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values * attended, b.values * attended, rtol=1e-5, atol=1e-5)


def _run(model, first: list[Row], late: list[Row], *, ragged: bool) -> DecodeBatch:
    """Admit `first`, decode two steps, admit `late`, decode to the end."""
    batch = DecodeBatch(model, 0, None)
    batch.prefill_group_cost = 0.0 if ragged else float("inf")
    widths: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        with torch.inference_mode():
            batch.admit(first)
            for _ in range(2):
                batch.step()
                batch.pop_finished()
            batch.admit(late)
            while len(batch):
                batch.step()
                batch.pop_finished()
    finally:
        hook.remove()
    prefills = [w for w in widths if w > 1]
    assert prefills == ([14, 9, 7, 3, 2, 12, 5] if ragged else [14, 12])  # a forward per length
    return batch


def _full_logprobs(model, ids: list[int], out: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(out)[:, None])[:, 0]


@pytest.mark.parametrize("family", ["llama", "qwen3", "llama_gqa", "mixtral"])
def test_grouped_prefill_batch_decodes_like_the_padded_one(family):
    model = _model("llama", kv=2) if family == "llama_gqa" else _model(family)
    if family == "llama_gqa":
        use_grouped_sdpa(model)
    first = _prompts([3, 14, 9, 14, 2, 7], seed=3)
    first[3] = first[1]  # a shared prompt
    late = _prompts([5, 12, 1], seed=4)  # the 1-token prompt: a width-1 forward, like a step
    specs = [
        (p, 2 + i % 5, i, i % 2 == 0) for i, p in enumerate(first + late)
    ]  # (prompt, max new, seed, lps)

    def rows():
        made = [_row(p, n, s, lp) for p, n, s, lp in specs]
        return made[: len(first)], made[len(first) :]

    (a_first, a_late), (b_first, b_late) = rows(), rows()
    batch = _run(model, a_first, a_late, ragged=True)
    _run(model, b_first, b_late, ragged=False)
    assert batch.prefill_tokens_saved == 14
    for a, b in zip(a_first + a_late, b_first + b_late, strict=True):
        assert a.output_ids == b.output_ids and a.finish == b.finish == "length"
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)
        want = _full_logprobs(model, a.request.input_ids, a.output_ids)
        assert a.output_logprobs == pytest.approx(want.tolist(), abs=1e-4)
        if a.request.return_logprob:
            assert a.input_logprobs[1:] == pytest.approx(b.input_logprobs[1:], abs=1e-5)
