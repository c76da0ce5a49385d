"""Aborting or cancelling a huge queue costs the caller's event loop one wake-up, not one per
request (issue 25, item 7: `verst serve` with 6 x 4096 queued sequences took 10-28 s to exit
on SIGTERM, its loop busy with a `call_soon_threadsafe` per queued row).

A real embedded engine on the tiny model, paused so every request stays queued; the loop's
`call_soon_threadsafe` is counted while the queue is aborted (every caller still gets its
`abort` answer) and while thousands of waiting callers are cancelled (nobody reads those
answers: no wake-up at all, and the queue is emptied in one pass).
"""

from __future__ import annotations

import asyncio

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded.engine import EmbeddedEngine

QUEUED = 2000


class CountedLoop:
    """Counts `call_soon_threadsafe` on the running loop (the engine thread's wake-ups)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.calls = loop, 0
        self.real = loop.call_soon_threadsafe

        def counted(*args, **kwargs):
            self.calls += 1
            return self.real(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]

    def close(self) -> None:
        self.loop.call_soon_threadsafe = self.real  # type: ignore[method-assign]


async def _queue(engine: EmbeddedEngine, n: int) -> list[asyncio.Task]:
    engine.pause()  # nothing is admitted: every request stays in the queue
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    tasks = [asyncio.ensure_future(engine.generate(GenerateRequest([1, 2, 3], sp))) for _ in range(n)]
    while engine.load()["num_waiting_reqs"] < n:
        await asyncio.sleep(0.01)
    return tasks


def test_aborting_a_huge_queue_wakes_the_callers_loop_once_and_answers_everyone(tiny_checkpoint):
    async def main() -> None:
        engine = EmbeddedEngine.from_pretrained(tiny_checkpoint)
        try:
            tasks = await _queue(engine, QUEUED)
            counter = CountedLoop(asyncio.get_running_loop())
            try:
                await engine.abort()
                outs = await asyncio.gather(*tasks)
            finally:
                counter.close()
            assert {o.finish_reason for o in outs} == {"abort"} and len(outs) == QUEUED
            assert all(o.prompt_tokens == 3 and o.output_ids == [] for o in outs)
            assert counter.calls <= 3, (
                f"{counter.calls} wake-ups of the caller's loop for {QUEUED} aborted rows"
            )
        finally:
            await engine.close()

    asyncio.run(main())


def test_cancelling_thousands_of_waiting_callers_wakes_no_loop_and_empties_the_queue(tiny_checkpoint):
    async def main() -> None:
        engine = EmbeddedEngine.from_pretrained(tiny_checkpoint)
        try:
            tasks = await _queue(engine, QUEUED)
            counter = CountedLoop(asyncio.get_running_loop())
            try:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                for _ in range(200):  # the worker drops them between steps
                    if engine.load()["num_waiting_reqs"] == 0:
                        break
                    await asyncio.sleep(0.01)
            finally:
                counter.close()
            assert engine.load()["num_waiting_reqs"] == 0, "cancelled requests stayed queued"
            assert counter.calls == 0, f"{counter.calls} wake-ups for answers nobody waits for"
            engine.resume()  # the engine still serves
            out = await engine.generate(
                GenerateRequest([1, 2], SamplingParams(max_new_tokens=2, ignore_eos=True))
            )
            assert out.finish_reason == "length" and len(out.output_ids) == 2
        finally:
            await engine.close()

    asyncio.run(main())
