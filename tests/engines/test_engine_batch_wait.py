"""An idle embedded engine collects a first request's companions before prefilling.

The wait restarts with every arrival (a rollout submitting its requests one by one gets a single
prefill) and is capped at `BATCH_WAIT_CAP × batch_wait_s` (a steady trickle cannot stall it).
"""

from __future__ import annotations

import asyncio

import pytest

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded.engine import EmbeddedEngine


def admits_of(engine: EmbeddedEngine) -> list[int]:
    sizes: list[int] = []
    original = engine._batch.admit

    def counting(rows):
        sizes.append(len(rows))
        original(rows)

    engine._batch.admit = counting  # the worker thread looks the method up on every admit
    return sizes


@pytest.fixture
def make_engine(tiny_checkpoint):
    engines: list[EmbeddedEngine] = []

    def make(**kwargs) -> EmbeddedEngine:
        engines.append(EmbeddedEngine.from_pretrained(tiny_checkpoint, **kwargs))
        return engines[-1]

    yield make
    for e in engines:
        asyncio.run(e.close())


def request(i: int) -> GenerateRequest:
    return GenerateRequest([1, 4 + i % 40, 5], SamplingParams(3, temperature=1.0, ignore_eos=True))


async def test_requests_arriving_one_by_one_share_one_prefill(make_engine):
    engine = make_engine(batch_wait_s=0.25)
    sizes = admits_of(engine)
    tasks = []
    for i in range(8):  # 8 arrivals 20 ms apart, each well within the 250 ms gap
        tasks.append(asyncio.ensure_future(engine.generate(request(i))))
        await asyncio.sleep(0.02)
    outs = await asyncio.gather(*tasks)
    assert all(len(o.output_ids) == 3 for o in outs)
    assert sizes == [8]


async def test_a_steady_trickle_does_not_stall_the_first_prefill(make_engine):
    engine = make_engine(batch_wait_s=0.04)  # cap: 0.4 s
    sizes = admits_of(engine)
    tasks = []
    for i in range(40):  # one arrival every 30 ms for 1.2 s, each within the 40 ms gap
        tasks.append(asyncio.ensure_future(engine.generate(request(i))))
        await asyncio.sleep(0.03)
    await asyncio.gather(*tasks)
    assert len(sizes) >= 2 and sum(sizes) == 40
    assert sizes[0] < 40
