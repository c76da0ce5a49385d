"""A weight-update session that fails to open on one of several servers is rolled back on the
others (issue 25, item 19): no server is left paused with an open session, both in the SGLang
client's own refit (a router's workers) and in the `distributed` transport's push (an engine
per server).

Real parts: two `verst serve` apps (tiny model) on loopback, which refuse a second
`/begin_weight_update` while a session is open, as SGLang 0.5.23 does. The fault: a session
opened beforehand on the second server, so the refit's begin fails there. The router is a
stand-in that only lists the workers (as in test_engine_sglang_client.py).
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import AsyncExitStack

import pytest
from test_engine_sglang_client import in_process_server, stand_in_router

from verst.rollout.engine import EngineError, GenerateRequest, SamplingParams
from verst.rollout.engines.sglang.client import SGLangClient


class Loop:
    """An event loop in a thread: the servers and clients live there; tests call from outside."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout: float = 60):
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def two_servers(tiny_checkpoint):
    loop, stack = Loop(), AsyncExitStack()

    async def start():
        return [await stack.enter_async_context(in_process_server(tiny_checkpoint)) for _ in range(2)]

    urls = loop.run(start(), timeout=120)
    yield loop, urls
    loop.run(stack.aclose())
    loop.close()


async def _not_in_session(url: str) -> None:
    """The server is not paused and has no session open: it generates, and a session opens."""
    client = SGLangClient(url)
    try:
        out = await asyncio.wait_for(client.generate(GenerateRequest([1, 6], SamplingParams(2))), 20)
        assert len(out.output_ids) == 2
        await client.begin_weight_update()  # refused if a session were still open
        await client.end_weight_update(None, check=False)
    finally:
        await client.close()


def test_client_refit_rolls_back_the_workers_where_begin_succeeded(two_servers):
    loop, (a, b) = two_servers

    async def go():
        blocker = SGLangClient(b)
        await blocker.begin_weight_update()  # the fault: b already has a session open
        async with stand_in_router([a, b], old_form=False) as router:
            via_router = SGLangClient(router, router=True, max_retries=1, backoff_s=0.01)
            try:
                with pytest.raises(EngineError, match="begin_weight_update failed on 1 of 2") as info:
                    await via_router.begin_weight_update()
            finally:
                await via_router.close()
        await _not_in_session(a)  # before the fix: a stayed paused with its session open
        assert "rolled back on the other 1" in str(info.value)
        await blocker.end_weight_update(None, check=False)
        await blocker.close()
        await _not_in_session(b)

    loop.run(go(), timeout=120)


def test_distributed_push_ends_the_sessions_it_opened_when_one_engine_refuses(two_servers):
    import torch

    from verst.trainer.sync.distributed import DistributedTransport
    from verst.trainer.sync.modes import DistributedSyncConfig

    loop, (a, b) = two_servers

    async def clients():
        return SGLangClient(a), SGLangClient(b)

    engine_a, engine_b = loop.run(clients())
    loop.run(engine_b.begin_weight_update())  # the fault: b refuses the push's begin

    class Surface:  # what the transport uses of the rollout side: its engines and its loop
        engine = type("Pool", (), {"engines": [engine_a, engine_b]})()
        submit = staticmethod(loop.submit)

    transport = DistributedTransport(DistributedSyncConfig(group_timeout_s=30))
    transport.group = object()  # joined already; the begin fails before any broadcast
    with pytest.raises(EngineError, match="already open"):
        transport.push(Surface(), {"w": torch.zeros(2)}, 1)
    loop.run(_not_in_session(a), timeout=60)
    loop.run(engine_b.end_weight_update(None, check=False))
    for e in (engine_a, engine_b):
        loop.run(e.close())
