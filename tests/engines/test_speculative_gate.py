"""The cost gate (`engine.speculative.gate = "auto"`): on a real tiny model it turns speculation
off when every proposal fails and runs the same tokens as plain decoding; its decision keeps
speculation on where acceptance pays for the verify forward and off where it cannot, and a
seeded row's choice does not depend on what shares its batch or on timings."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.engines.embedded.speculative.gate import CostGate, expected_tokens
from verst.rollout.engines.embedded.speculative.step import RowSpec


class WrongProposer:
    """Proposes the last vocabulary id, which the tiny model's greedy decoding never emits: the
    fault of a proposer whose proposals always fail."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def propose(self, batch, rows, caps):
        return [[self.vocab - 1] * c for c in caps], None

    def refit(self, named) -> None:
        pass


async def _generate(model, gate: str, n: int):
    engine = EmbeddedEngine.from_pretrained(
        model, speculative={"type": "ngram", "num_tokens": 4, "gate": gate}, batch_wait_s=0.05
    )
    engine._batch.speculative.proposer = WrongProposer(engine.vocab_size)
    reqs = [
        GenerateRequest([1] + [4 + (i + j) % 7 for j in range(10)], SamplingParams(48, 0.0, ignore_eos=True))
        for i in range(n)
    ]
    try:
        outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
        return [o.output_ids for o in outs], engine.speculative_stats
    finally:
        await engine.close()


async def test_gate_turns_failing_proposals_off(tiny_checkpoint):
    on, gated = await _generate(tiny_checkpoint, "auto", 8)
    off, ungated = await _generate(tiny_checkpoint, "off", 8)
    assert on == off  # greedy: the same tokens either way
    assert ungated["accepted"] == 0 and ungated["gated"] == 0
    steps = gated["steps"] + gated["plain_steps"]
    assert gated["steps"] < ungated["steps"] and gated["steps"] / steps < 0.1
    assert gated["gated"] > 0


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


def test_probe_runs_after_probe_every_plain_steps():
    gate = _timed(1.0, {1: 3.0})
    for _ in range(gate.probe_every):
        assert gate.choose(_rows([0.0]), [4]) == [0]
        gate.observe(0, 1.0, 1)
    assert gate.choose(_rows([0.0]), [4]) == [1]


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
