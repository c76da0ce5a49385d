"""No lost wake-up between `_submit` and the embedded engine's worker: every request, however
its arrival interleaves with the worker's waits (idle, collecting companions, a full batch,
paused), is served within a bound. A real engine on the tiny model.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded.engine import EmbeddedEngine


def request(i: int, tokens: int = 3) -> GenerateRequest:
    return GenerateRequest([1, 4 + i % 40, 5], SamplingParams(tokens, temperature=1.0, ignore_eos=True))


def count_waits(engine: EmbeddedEngine) -> list[int]:
    calls = [0]
    real = engine._cond.wait

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    engine._cond.wait = counted  # type: ignore[method-assign]
    return calls


async def test_the_request_that_fills_the_batch_ends_the_companion_wait(tiny_checkpoint):
    engine = EmbeddedEngine.from_pretrained(tiny_checkpoint, max_batch_size=4, batch_wait_s=5.0)
    try:
        start = time.monotonic()
        tasks = []
        for i in range(4):  # arrivals 20 ms apart: the worker is collecting when the 4th comes
            tasks.append(asyncio.ensure_future(engine.generate(request(i))))
            await asyncio.sleep(0.02)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=4.0)  # well before batch_wait_s
        assert time.monotonic() - start < 4.0
    finally:
        await engine.close()


async def test_a_request_submitted_while_paused_runs_on_resume(tiny_checkpoint):
    engine = EmbeddedEngine.from_pretrained(tiny_checkpoint, batch_wait_s=0.01)
    try:
        engine.pause()
        task = asyncio.ensure_future(engine.generate(request(0)))
        await asyncio.sleep(0.1)  # the worker is idle-waiting (paused) when it arrives
        assert not task.done()
        later = asyncio.ensure_future(engine.generate(request(1)))  # no wake-up for this one
        await asyncio.sleep(0.05)
        engine.resume()
        outs = await asyncio.wait_for(asyncio.gather(task, later), timeout=10.0)
        assert [len(o.output_ids) for o in outs] == [3, 3]
    finally:
        await engine.close()


@pytest.mark.parametrize("seed", range(6))
async def test_no_request_is_left_unserved_whatever_the_arrival_timing(tiny_checkpoint, seed):
    """Many tasks submit at random delays around the worker's waits (idle, collecting, a full
    batch, the queue longer than the batch); all finish within a bound far below a hang."""
    rng = random.Random(seed)
    wait_s = rng.choice([0.0, 0.001, 0.005, 0.02])
    engine = EmbeddedEngine.from_pretrained(
        tiny_checkpoint, max_batch_size=rng.choice([1, 3, 8, 64]), batch_wait_s=wait_s
    )

    async def one(i: int) -> int:
        await asyncio.sleep(rng.choice([0.0, 0.0, rng.uniform(0, 0.003), rng.uniform(0, 0.05)]))
        out = await engine.generate(request(i, tokens=rng.randint(1, 4)))
        return len(out.output_ids)

    try:
        for _ in range(3):  # bursts separated by idle gaps: the worker goes back to its idle wait
            n = rng.randint(1, 80)
            lengths = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), timeout=30.0)
            assert len(lengths) == n and all(1 <= k <= 4 for k in lengths)
            await asyncio.sleep(rng.uniform(0, 0.05))
    finally:
        await engine.close()


def test_submissions_from_many_event_loops_on_threads_are_all_served(tiny_checkpoint):
    """Callers on their own loops in their own threads race each other and the worker."""
    import threading

    engine = EmbeddedEngine.from_pretrained(tiny_checkpoint, max_batch_size=8, batch_wait_s=0.002)
    results: list[int] = []
    expected = [0]
    lock = threading.Lock()

    def caller(seed: int) -> None:
        rng = random.Random(seed)

        async def main() -> None:
            for _ in range(5):
                await asyncio.sleep(rng.uniform(0, 0.01))
                n = rng.randint(1, 6)
                with lock:
                    expected[0] += n
                outs = await asyncio.wait_for(
                    asyncio.gather(*(engine.generate(request(i)) for i in range(n))), timeout=30.0
                )
                with lock:
                    results.extend(len(o.output_ids) for o in outs)

        asyncio.run(main())

    threads = [threading.Thread(target=caller, args=(s,)) for s in range(6)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert len(results) == expected[0] > 0 and set(results) == {3}
    finally:
        asyncio.run(engine.close())
