"""The colocated release/resume order around eval, step 0 and each refit, against `verst serve`.

`verst serve` refuses what SGLang 0.5.23 cannot do (release while busy, generate on released
memory, generate after weights were released without a CPU backup and not reloaded, refit into
released weights), so driving the controller's sequence — eval(0), rollout(0), refit, eval,
rollout, refit — through `ColocatedMemory` and the real client fails if the order regresses.
The calls the server received are recorded and checked in order.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from safetensors.torch import load_file
from serve_testlib import serve

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.sglang.client import SGLangClient
from verst.trainer.sync.colocate import ColocatedMemory, ColocatedMemoryError

PROMPT = [1, 8, 9, 10]


class _Loop:
    """An event loop in a thread: the engine side; `run` blocks like the trainer does."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def engine_side(tiny_checkpoint):
    loop, record = _Loop(), []
    ctx = serve(tiny_checkpoint, record=record)
    url = loop.run(ctx.__aenter__())
    client = SGLangClient(url, abort_resend_s=0)
    yield loop, client, record
    loop.run(client.close())
    loop.run(ctx.__aexit__(None, None, None))
    loop.close()


def test_release_resume_order_around_eval_step0_and_refit(engine_side, tiny_checkpoint):
    loop, client, record = engine_side
    memory = ColocatedMemory(client, loop.run, colocated=True)
    state = load_file(str(tiny_checkpoint / "model.safetensors"))

    def generate() -> None:  # an eval or a rollout: verst serve refuses released memory
        memory.before_generate()
        loop.run(client.generate(GenerateRequest(PROMPT, SamplingParams(3))))

    def refit(version: int) -> None:
        memory.before_refit()
        assert loop.run(client.update_weights_from_tensors(state, version)) == version
        memory.after_refit()

    generate()  # eval at step 0: nothing was released
    for step in range(2):
        generate()  # rollout
        memory.after_rollout()
        assert memory.released == ["weights", "kv_cache", "cuda_graph"]
        record.clear()
        refit(step + 1)
        calls = [(p, (b or {}).get("tags")) for p, b in record if "memory" in p or "generation" in p]
        assert calls[0] == ("/resume_memory_occupation", ["weights"])  # weights first, still paused
        # the refit itself must not continue generation while the KV cache is still released
        assert [c for c in calls[:-1] if c[0] == "/continue_generation"] == []
        assert calls[-2:] == [
            ("/resume_memory_occupation", ["kv_cache", "cuda_graph"]),
            ("/continue_generation", None),
        ]
        record.clear()
        generate()  # eval after the refit: runs on live weights, releases nothing
        assert not [p for p, _ in record if "release" in p]
    # the release after a rollout paused (retract) first: SGLang asserts an idle server
    memory.after_rollout()
    tail = [(p, b) for p, b in record if p in ("/pause_generation", "/release_memory_occupation")]
    assert tail == [
        ("/pause_generation", {"mode": "retract"}),
        ("/release_memory_occupation", {"tags": None}),
    ]
    # generating before the refit would run on released (lost) weights: refused up front
    with pytest.raises(ColocatedMemoryError, match="refit"):
        memory.before_generate()


def test_the_old_order_is_caught_by_the_server(engine_side):
    """Release everything after an eval and roll out next: the weights are gone (no CPU backup)."""
    loop, client, _ = engine_side
    loop.run(client.release_memory_occupation(None))
    loop.run(client.resume_memory_occupation(None))
    from verst.rollout.engines.common.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="cpu-backup"):
        loop.run(client.generate(GenerateRequest(PROMPT, SamplingParams(2))))


def test_not_colocated_or_no_hooks_is_a_no_op(engine_side):
    loop, client, record = engine_side
    record.clear()
    memory = ColocatedMemory(client, loop.run, colocated=False)
    memory.after_rollout()
    memory.before_refit()
    memory.after_refit()
    memory.before_generate()
    assert record == [] and not memory.enabled
    assert not ColocatedMemory(object(), loop.run, colocated=True).enabled
