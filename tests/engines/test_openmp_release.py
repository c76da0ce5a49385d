"""A thread hands its OpenMP workers back (`verst.rollout.openmp`), and the embedded engine does
so when it goes idle, so the trainer's kernels run with the process's only worker team.

Real threads of the real runtime in `/proc/self/task`, each team's workers told apart by the
name they inherit from the thread that owns the team (`openmp_testlib`).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from openmp_testlib import name_thread, parallel_kernel, requires_libgomp, tids, until, workers_of

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
    release_openmp_workers()  # this thread's team (if any) out of the way
    seen: dict[str, object] = {}

    def worker() -> None:
        seen["team"] = team = parallel_kernel()
        seen["released"] = release_openmp_workers()
        seen["left"] = team & tids()
        seen["again"] = again = parallel_kernel()  # a fresh team: the runtime still works
        release_openmp_workers()
        seen["left_again"] = again & tids()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert len(seen["team"]) == 1, seen  # one worker beside the thread itself
    assert seen["released"] is True and not seen["left"], seen
    assert len(seen["again"]) == 1 and not seen["left_again"], seen

    mine = parallel_kernel()  # this thread's own team is untouched by another thread's release
    assert len(mine) == 1
    release_openmp_workers()
    assert not mine & tids()


def decode(engine: EmbeddedEngine) -> set[int]:
    """Decode 64 rows; the engine's workers seen while they streamed."""
    tid = engine._thread.native_id
    name = name_thread(tid)  # the engine thread's workers inherit the name
    seen: set[int] = set()
    request = GenerateRequest(
        [5, 6, 7, 8], SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)
    )

    async def drain(stream) -> None:
        async for _ in stream:
            seen.update(workers_of(tid, name))

    async def run() -> None:
        await asyncio.gather(*(drain(engine.generate_stream(request)) for _ in range(64)))

    asyncio.run(run())
    return seen


@pytest.fixture
def engine():
    model = build_tiny_llama(8192, hidden_size=256, num_layers=2, num_heads=4)
    engine = EmbeddedEngine(model, None, max_batch_size=64)
    yield engine
    asyncio.run(engine.close())


def test_an_idle_engine_hands_its_workers_back(two_threads, engine):
    release_openmp_workers()
    workers = decode(engine)
    assert workers, "the engine's decode ran parallel kernels (a worker team existed)"
    assert until(lambda: not workers & tids()), f"threads {workers & tids()} outlived the decode"


def test_a_short_gap_keeps_the_engines_workers(two_threads, engine):
    engine.IDLE_RELEASE_S = 3.0  # read by the worker at each idle moment
    release_openmp_workers()
    workers = decode(engine)
    assert workers
    time.sleep(0.3)  # idle, but well within IDLE_RELEASE_S: the same team serves the next decode
    again = decode(engine)
    assert again == workers, (workers, again)
    assert until(lambda: not workers & tids()), "released once idle for IDLE_RELEASE_S"
