"""A thread hands its OpenMP workers back (`verst.rollout.openmp`), and the embedded engine does
so when it goes idle, so the trainer's kernels run with the process's only worker team.

Real threads of the real runtime: the process's thread count (`/proc/self/task`) shows the
workers a parallel kernel starts and the ones a release joins.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from openmp_testlib import parallel_kernel, requires_libgomp, threads, until

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.openmp import release_openmp_workers
from verst.rollout.toy import build_tiny_llama

pytestmark = requires_libgomp


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_release_joins_the_calling_threads_workers_only(two_threads):
    release_openmp_workers()  # this thread's team (if any) out of the counts below
    seen: dict[str, int] = {}

    def worker() -> None:
        seen["start"] = threads()
        parallel_kernel()
        seen["team"] = threads()
        seen["released"] = int(release_openmp_workers())
        seen["after"] = threads()
        parallel_kernel()  # a fresh team: the runtime still works
        seen["again"] = threads()
        release_openmp_workers()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["team"] == seen["start"] + 1, seen  # one worker beside the thread itself
    assert seen["released"] == 1 and seen["after"] == seen["start"], seen
    assert seen["again"] == seen["start"] + 1, seen

    parallel_kernel()  # this thread's own team is untouched by another thread's release
    mine = threads()
    release_openmp_workers()
    assert threads() == mine - 1


def test_an_idle_engine_hands_its_workers_back(two_threads):
    model = build_tiny_llama(8192, hidden_size=256, num_layers=2, num_heads=4)
    engine = EmbeddedEngine(model, None, max_batch_size=64)
    try:
        release_openmp_workers()
        base = threads()  # the engine's thread included, no worker team anywhere
        peak = [base]

        async def run() -> None:
            request = GenerateRequest(
                [5, 6, 7, 8], SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)
            )
            streams = [engine.generate_stream(request) for _ in range(64)]

            async def drain(stream) -> None:
                async for _ in stream:
                    peak[0] = max(peak[0], threads())

            await asyncio.gather(*(drain(s) for s in streams))

        asyncio.run(run())
        assert peak[0] > base, "the engine's decode ran parallel kernels (a worker team existed)"
        assert until(lambda: threads() == base), f"{threads()} threads, {base} with no worker team"
    finally:
        asyncio.run(engine.close())
