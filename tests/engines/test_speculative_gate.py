"""The cost gate (`engine.speculative.gate = "auto"`), on a real tiny model with the real n-gram
proposer: it keeps speculation on where proposals are accepted (and turns it back on when they
start being accepted after failing), and turns it off where every proposal fails, decoding then
with the forwards and fed tokens of plain decoding (counted at the embedding layer, not timed);
its decision keeps speculation on where acceptance pays for the verify forward and off where it
cannot, probes with doubling gaps, and a seeded row's choice does not depend on what shares its
batch or on timings."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.engines.embedded.speculative.gate import CostGate, expected_tokens
from verst.rollout.engines.embedded.speculative.metrics import speculative_metrics
from verst.rollout.engines.embedded.speculative.step import RowSpec

torch.set_num_threads(1)
NGRAM = {"type": "ngram", "num_tokens": 4, "min_ngram": 1}


class WrongProposer:
    """Proposes the last vocabulary id, which the tiny model's greedy decoding never emits: the
    fault of a proposer whose proposals always fail."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def propose(self, batch, rows, caps):
        return [[self.vocab - 1] * c for c in caps], None

    def refit(self, named) -> None:
        pass


async def _decode(model, reqs, speculative=None, wrong=False, ragged=True, logprobs=False):
    """(token ids, speculative counters, the tokens of every forward the engine ran)."""
    engine = EmbeddedEngine.from_pretrained(model, speculative=speculative, batch_wait_s=0.05)
    fed: list[int] = []  # every forward embeds its input ids: prefill, plain and verify
    engine._batch.model.get_input_embeddings().register_forward_hook(lambda m, a, o: fed.append(a[0].numel()))
    if wrong:
        engine._batch.speculative.proposer = WrongProposer(engine.vocab_size)
    if speculative is not None:
        engine._batch.speculative.ragged = ragged
    try:
        outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
        ids = [o.output_ids for o in outs]
        return (ids, [o.output_logprobs for o in outs]) if logprobs else ids, engine.speculative_stats, fed
    finally:
        await engine.close()


def _fraction(stats, key):
    return speculative_metrics(None, stats)[f"rollout/speculative/{key}"]


def _greedy(prompts, n, seeded):
    return [
        GenerateRequest(p, SamplingParams(n, 0.0, ignore_eos=True, sampling_seed=100 + i if seeded else None))
        for i, p in enumerate(prompts)
    ]


def _starts(rows: int, vocab: int = 64) -> list[list[int]]:
    return [[1, *[4 + (7 * i + 3 * j) % (vocab - 4) for j in range(20)]] for i in range(rows)]


@pytest.mark.parametrize("seeded", [False, True])
async def test_gate_stays_on_where_proposals_are_accepted(tiny_checkpoint, seeded):
    """A copy-heavy workload: each prompt ends with the model's own greedy continuation of its
    start (it has fallen into a loop), so prompt lookup keeps predicting the next tokens."""
    lead, _, _ = await _decode(tiny_checkpoint, _greedy(_starts(8), 40, False))
    prompts = [s + out for s, out in zip(_starts(8), lead, strict=True)]
    reqs = _greedy(prompts, 64, seeded)
    plain, _, plain_fed = await _decode(tiny_checkpoint, reqs)
    spec, stats, fed = await _decode(tiny_checkpoint, reqs, {**NGRAM, "gate": "auto"})
    assert spec == plain  # greedy: token-identical
    assert stats["accepted"] > 0.8 * stats["proposed"]
    # most tokens come from verification steps (a fraction of steps would undercount them: since
    # a loop is proposed `k` long, a verify step emits up to 5 tokens and the plain steps left
    # are mostly the rows' last tokens, where no proposal fits the budget)
    assert stats["emitted"] >= (0.8 if seeded else 0.9) * sum(map(len, spec))
    assert len(fed) <= (0.9 if seeded else 0.7) * len(plain_fed)  # fewer forwards for the same tokens


@pytest.mark.parametrize("seeded", [False, True])
async def test_gate_comes_back_on_when_proposals_start_being_accepted(tiny_checkpoint, seeded):
    """The first proposals fail (the prompt is a run of distinct ids the model does not repeat),
    then the model falls into a loop that prompt lookup predicts: the gate's probes find out."""
    prompts = [[1, *range(4, 14 + 3 * i)] for i in range(8)]
    reqs = _greedy(prompts, 64, seeded)
    plain, _, plain_fed = await _decode(tiny_checkpoint, reqs)
    spec, stats, fed = await _decode(tiny_checkpoint, reqs, {**NGRAM, "gate": "auto"})
    assert spec == plain and all(len(set(out[-24:])) <= 3 for out in plain)  # it ends in a loop
    assert stats["gated"] > 0  # it did turn off ...
    # ... and back on (before the doubling probe gaps: 0.02 and 0.38; unseeded rows read timings)
    assert _fraction(stats, "speculated_fraction") >= (0.6 if seeded else 0.3)
    assert len(fed) <= 0.9 * len(plain_fed)


@pytest.mark.parametrize("seeded", [False, True])
async def test_gate_turns_failing_proposals_off_at_plain_cost(tiny_checkpoint, seeded):
    """Every proposal fails: with the gate decode runs the forwards plain decoding runs and feeds
    within a few percent of its tokens (the probes); without it every verify step pads rows."""
    reqs = _greedy([[1] + [4 + (i + j) % 7 for j in range(10)] for i in range(8)], 128, seeded)
    plain, _, plain_fed = await _decode(tiny_checkpoint, reqs)
    on, gated, on_fed = await _decode(tiny_checkpoint, reqs, {**NGRAM, "gate": "auto"}, wrong=True)
    off, ungated, off_fed = await _decode(tiny_checkpoint, reqs, {**NGRAM, "gate": "off"}, wrong=True)
    assert on == off == plain  # greedy: the same tokens either way
    assert gated["accepted"] == ungated["accepted"] == 0 and ungated["gated"] == 0
    assert _fraction(gated, "speculated_fraction") <= 0.06  # the first step and the probes
    assert _fraction(gated, "gated_fraction") >= 0.75  # the other plain steps: the back-off's pauses
    assert len(on_fed) == len(plain_fed)  # a rejected verify step emits one token per row, as a plain one
    decode = sum(plain_fed[1:])  # the prefill (same in all three) aside
    extra = sum(on_fed) - sum(plain_fed)
    assert 0 < extra <= 0.06 * decode  # the probes
    assert sum(off_fed) - sum(plain_fed) >= 2 * extra  # the back-off alone


def _rows(accepts, seeded=False):
    return [
        SimpleNamespace(
            spec=RowSpec(4, accept=a), sampling=SimpleNamespace(seed=7 if seeded else None), output_ids=[0]
        )
        for a in accepts
    ]


def _timed(plain: float, verify: dict[int, float]) -> CostGate:
    gate = CostGate()
    gate.observe(0, plain, 1)
    for k, t in verify.items():
        gate.observe(k, t, 1)
    return gate


def test_copy_workload_keeps_speculation_on_where_a_forward_is_cheap():
    gate = _timed(1.0, {1: 1.1, 2: 1.2, 3: 1.3, 4: 1.4})  # overhead-bound: small batch
    assert gate.choose(_rows([0.9] * 8), [4] * 8) == [4] * 8
    assert gate.choose(_rows([0.0] * 8), [4] * 8) == [0] * 8


def test_compute_bound_forward_needs_near_certain_acceptance():
    gate = _timed(1.0, {k: 1.0 + 0.9 * k for k in range(1, 5)})  # k + 1 tokens cost ~k + 1 steps
    assert gate.choose(_rows([0.5] * 64), [4] * 64) == [0] * 64
    assert gate.choose(_rows([1.0] * 64), [4] * 64) == [4] * 64


def _probes(gate, rows, steps):
    """The steps (of `steps` plain-or-probe steps) at which `gate` probes `rows` (acceptance 0)."""
    at = []
    for step in range(steps):
        caps = gate.choose(rows, [4] * len(rows))
        if any(caps):
            assert caps == [1] * len(rows)
            at.append(step)
            gate.observe(1, 3.0, 1)
        else:
            gate.observe(0, 1.0, 1)
        for r in rows:
            r.output_ids.append(0)
    return at


def test_probes_double_their_gap_up_to_probe_every():
    gate = _timed(1.0, {1: 3.0})
    gate.plain_run = 0
    at = _probes(gate, _rows([0.0]), 300)
    gaps = [b - a - 1 for a, b in itertools.pairwise([-1, *at])]  # plain steps before each probe
    assert gaps[:6] == [4, 8, 16, 32, 64, 64] and all(g == 64 for g in gaps[4:])


def test_seeded_rows_probe_on_their_own_doubling_schedule():
    at = _probes(CostGate(), _rows([0.0], seeded=True), 300)
    gaps = [b - a for a, b in itertools.pairwise(at)]  # output tokens between probes
    assert gaps[:5] == [8, 16, 32, 64, 64] and at[0] == 4


def test_probe_gap_resets_once_speculation_pays():
    gate = _timed(1.0, {k: 1.0 + 0.1 * k for k in range(1, 5)})
    gate.probe_gap = gate.probe_every
    assert gate.choose(_rows([0.9] * 4), [4] * 4) == [4] * 4
    assert gate.probe_gap == gate.probe_min


@given(st.floats(0.0, 1.0), st.lists(st.floats(0.0, 1.0), max_size=8), st.floats(0.1, 10.0))
def test_seeded_rows_choose_alone(a, others, slow):
    """A seeded row's cap depends on its own acceptance only: not on its neighbours, not on timings."""
    alone = CostGate().choose(_rows([a], seeded=True), [4])[0]
    gate = _timed(1.0, {k: slow * k for k in range(1, 5)})
    crowd = gate.choose(_rows([a], seeded=True) + _rows(others), [4] * (1 + len(others)))[0]
    assert alone == crowd


@given(st.floats(0.0, 0.999), st.integers(0, 16))
def test_expected_tokens_is_the_geometric_sum(a, m):
    assert abs(expected_tokens(a, m) - sum(a**i for i in range(m + 1))) < 1e-9


def test_new_rows_start_from_the_engines_running_acceptance():
    gate = _timed(1.0, {k: 1.0 + 0.3 * k for k in range(1, 5)})
    for r in _rows([None] * 8):
        for _ in range(40):
            gate.update(r.spec, 0, 4)  # every proposal so far failed
    assert gate.choose(_rows([None] * 8), [4] * 8) == [0] * 8  # a fresh unseeded row: off
    assert gate.choose(_rows([None], seeded=True), [4]) != [0]  # a fresh seeded row: its prior


async def test_ragged_verify_computes_each_rows_own_tokens_only(tiny_checkpoint):
    """Rows propose different numbers of tokens (loops of different lengths, rows paused by their
    back-off): the ragged verify forward embeds each row's last token and its proposals only,
    and emits the padded forward's tokens with its log-probs (a plain forward's: the other tests)."""
    lead, _, _ = await _decode(tiny_checkpoint, _greedy(_starts(8), 40, False))
    prompts = [s + out for s, out in zip(_starts(8), lead, strict=True)] + [[1, *range(4, 30)]] * 4
    reqs = [
        GenerateRequest(p, SamplingParams(48, 0.0, ignore_eos=True), return_logprob=True) for p in prompts
    ]
    cfg = {**NGRAM, "gate": "off"}
    (r_ids, r_lp), r_stats, r_fed = await _decode(tiny_checkpoint, reqs, cfg, ragged=True, logprobs=True)
    (p_ids, p_lp), p_stats, p_fed = await _decode(tiny_checkpoint, reqs, cfg, ragged=False, logprobs=True)
    assert r_ids == p_ids and r_stats["steps"] == p_stats["steps"] > 0
    for a, b in zip(r_lp, p_lp, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    # every verify step's forward: the padded one feeds slots × (k + 1) tokens, the ragged one
    # Σ (1 + proposals); the embedding saw exactly that difference
    assert sum(p_fed) - sum(r_fed) == p_stats["fed"] - r_stats["fed"] > 0
    # (loops are proposed `k` long, `ngram._continuation`, so the looping rows pad little; the
    # rows of distinct ids, paused by their back-off, still save most of their slots)
    assert r_stats["fed"] <= 0.9 * p_stats["fed"]
    assert r_stats["fed"] <= r_stats["proposed"] + len(reqs) * r_stats["steps"]  # (slots: live ones ≤ 12)


@pytest.mark.parametrize("seeded", [False, True])
def test_a_probe_that_passes_resets_the_gap(seeded):
    """Proposals that start passing (a copy begins): the probes come back at `probe_min`."""
    gate = _timed(1.0, {1: 3.0})
    rows = _rows([0.0], seeded=seeded)
    first = _probes(gate, rows, 40)  # failing: doubling gaps
    gate.update(rows[0].spec, 1, 1)  # the last probe passed
    assert gate.probe_gap == gate.probe_min and rows[0].spec.probe_at is None
    again = _probes(gate, rows, 12)
    assert again and again[0] <= gate.probe_min + 1 and first[-1] - first[-2] > gate.probe_min + 1


async def test_ragged_verify_of_one_row_matches_the_padded_one(tiny_checkpoint):
    """One row: no padding, so the ragged forward skips its scatters (`ragged._scatter`); its
    tokens and log-probs are still the padded forward's."""
    lead, _, _ = await _decode(tiny_checkpoint, _greedy(_starts(1), 40, False))
    req = GenerateRequest(
        _starts(1)[0] + lead[0], SamplingParams(48, 0.0, ignore_eos=True), return_logprob=True
    )
    cfg = {**NGRAM, "gate": "off"}
    (r_ids, r_lp), r_stats, _ = await _decode(tiny_checkpoint, [req], cfg, ragged=True, logprobs=True)
    (p_ids, p_lp), p_stats, _ = await _decode(tiny_checkpoint, [req], cfg, ragged=False, logprobs=True)
    assert r_ids == p_ids and r_stats["steps"] == p_stats["steps"] > 0 and r_stats["accepted"] > 0
    assert torch.allclose(torch.tensor(r_lp[0]), torch.tensor(p_lp[0]), atol=1e-5)


def test_new_rows_start_from_the_rows_first_verifications():
    """A copy's rows pass their first verification and fail where the copy ends (tool_math: 4 of
    4, then 0 of 4 at the EOS): a new row is priced at the first verifications' acceptance, not
    at the mix, which here would not pay for the verify forward."""
    gate = _timed(1.0, {k: 1.0 + 0.3 * k for k in range(1, 5)})  # expected tokens must beat 2.2
    for r in _rows([None] * 16):
        gate.update(r.spec, 4, 4)
        for _ in range(3):
            gate.update(r.spec, 0, 4)
    assert gate.fresh == 1.0
    assert gate.choose(_rows([None] * 8), [4] * 8) == [4] * 8
    for r in _rows([None] * 40):
        gate.update(r.spec, 0, 4)  # new rows' first proposals start failing: new rows go off
    assert gate.choose(_rows([None] * 8), [4] * 8) == [0] * 8
