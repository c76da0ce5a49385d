"""Exactness while the cost gate switches (`engine.speculative.gate = "auto"`): on a real tiny
model with the real n-gram proposer and the real gate, set to probe after every plain step so that
rows turn speculation off and back on within a few tokens, (1) every emitted token, given the
tokens before it, follows the target's filtered softmax (chi-square, per temperature / top-k /
top-p), whether its step verified proposals, verified others' proposals with none of its own, or
ran plain; (2) a seeded request's tokens are the same alone, in a crowd of unseeded requests and
again, while its gate decisions switch."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest
import torch
from test_speculative_verify import chi_square_z, target

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.engines.embedded.sampling import RowSampling
from verst.rollout.engines.embedded.speculative.gate import CostGate

torch.set_num_threads(1)
SPEC = {"type": "ngram", "num_tokens": 2, "min_ngram": 1, "gate": "auto"}


class RecordingGate(CostGate):
    """The real gate, its decisions kept per request: (rid, cap offered, cap chosen)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.log: list[tuple[str, int, int]] = []

    def choose(self, rows, caps):
        out = super().choose(rows, caps)
        self.log.extend((r.request.rid, c, o) for r, c, o in zip(rows, caps, out, strict=True))
        return out


def _flipping_gate() -> RecordingGate:
    """Probes after one plain step (seeded rows: one output token), gaps growing to 2 only: a
    rejected proposal turns a row's speculation off, the next probe may turn it back on."""
    return RecordingGate(probe_min=1, probe_every=2, probe_gap=1)


async def _run(model, reqs, **kwargs):
    engine = EmbeddedEngine.from_pretrained(model, speculative=SPEC, batch_wait_s=0.05, **kwargs)
    gate = engine._batch.speculative.gate = _flipping_gate()
    try:
        outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
        return [o.output_ids for o in outs], engine.speculative_stats, gate.log
    finally:
        await engine.close()


def _switches(log) -> dict[str, tuple[int, int]]:
    """Per request: (turns off: a speculating step then a gated one, turns back on)."""
    last: dict[str, bool] = {}
    flips: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for rid, offered, chosen in log:
        if offered == 0:
            continue  # its own back-off paused it: not the gate's choice
        on = chosen > 0
        if rid in last and last[rid] != on:
            flips[rid][int(on)] += 1
        last[rid] = on
    return {rid: (a, b) for rid, (a, b) in flips.items()}


async def _prompt(model_dir):
    """Every token, then the model's greedy continuation: lookups propose likely tokens, kept
    often and rejected often at a low temperature (so the gate has reason to switch both ways)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    start = [1, *range(4, model.config.vocab_size)]
    engine = EmbeddedEngine.from_pretrained(model_dir)
    try:
        greedy = await engine.generate(GenerateRequest(start, SamplingParams(60, 0.0, ignore_eos=True)))
    finally:
        await engine.close()
    return model, [*start, *greedy.output_ids]


async def _check_distribution(model_dir, temperature, top_k, top_p, n=2400, length=5, least=100):
    model, prompt = await _prompt(model_dir)
    sampling = RowSampling(temperature, top_p, top_k)
    reqs = [
        GenerateRequest(
            prompt,
            SamplingParams(
                length, temperature, top_p, top_k, ignore_eos=True, sampling_seed=i if i % 2 else None
            ),
            rid=f"r{i}",
        )
        for i in range(n)
    ]
    outs, stats, log = await _run(model_dir, reqs, max_batch_size=600)
    flips = _switches(log)
    both = sum(1 for off, on in flips.values() if off and on)
    assert both >= 0.2 * n, f"the gate switched off and back on for {both} of {n} requests only"
    # (a batch this wide always has some row speculating: the switching is per row, within a step)
    assert 50 < stats["accepted"] < 0.9 * stats["proposed"]  # proposals kept and rejected
    seqs = torch.tensor(outs)  # [n, length]
    counts, probs = [], []
    for t in range(length):  # token t given tokens < t, every prefix seen `least` times
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for row in seqs.tolist():
            groups[tuple(row[:t])].append(row[t])
        for prefix, nexts in groups.items():
            if len(nexts) < least:
                continue
            with torch.no_grad():
                logits = model(torch.tensor([[*prompt, *prefix]])).logits[0, -1].float()
            counts.append(torch.bincount(torch.tensor(nexts), minlength=model.config.vocab_size))
            probs.append(target(logits, sampling) * len(nexts))
    total = torch.cat(counts)
    z = chi_square_z(total, torch.cat(probs) / total.sum())
    print(f"switched both ways: {both}/{n}, tested tokens {int(total.sum())}, z {z:.2f}, {stats}")
    assert total.sum() >= n  # on average a token per request is in a tested group
    assert z < 4.5, z


async def test_samples_follow_the_filtered_target_while_the_gate_switches(tiny_checkpoint):
    await _check_distribution(tiny_checkpoint, 0.1, 12, 0.95)


@pytest.mark.slow
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.2, -1, 1.0), (0.15, 5, 0.8), (0.3, 20, 0.9)])
async def test_samples_follow_the_filtered_target_while_the_gate_switches_more_settings(
    tiny_checkpoint, temperature, top_k, top_p
):
    await _check_distribution(tiny_checkpoint, temperature, top_k, top_p)


async def test_seeded_request_is_reproducible_while_the_gate_switches(tiny_checkpoint):
    _, prompt = await _prompt(tiny_checkpoint)
    mine = [
        GenerateRequest(
            prompt, SamplingParams(40, 0.3, 0.95, -1, ignore_eos=True, sampling_seed=11 + i), rid=f"s{i}"
        )
        for i in range(6)
    ]
    # the crowd: unseeded greedy rows whose proposals are all kept (the batch would speculate at
    # the full length every step, were the seeded rows to follow it)
    others = [
        GenerateRequest(prompt, SamplingParams(40, 0.0, ignore_eos=True), rid=f"u{i}") for i in range(10)
    ]
    alone, _, log = await _run(tiny_checkpoint, mine)
    crowd, _, crowd_log = await _run(tiny_checkpoint, [*others[:5], *mine, *others[5:]])
    again, _, _ = await _run(tiny_checkpoint, mine)
    assert alone == crowd[5:11] == again
    flips = _switches(log)
    assert all(flips.get(r.rid, (0, 0))[0] and flips[r.rid][1] for r in mine)  # each switched both ways
    assert _decisions(crowd_log, mine) == _decisions(log, mine)  # the same choices, whatever shares the batch


def _decisions(log, reqs) -> dict[str, list[tuple[int, int]]]:
    """Each request's (cap offered, cap chosen) in order, where its own back-off offered some."""
    out: dict[str, list[tuple[int, int]]] = {r.rid: [] for r in reqs}
    for rid, offered, chosen in log:
        if rid in out and offered:
            out[rid].append((offered, chosen))
    return out
