"""Per-sample overheads of a rollout, kept low without changing results.

- `SingleTurnGenerate` tokenises each text prompt once (a group's samples share it), per tokenizer.
- `JsonlSink` batches its writes but every line reaches the file within `flush_interval_s`.
"""

from __future__ import annotations

import asyncio
import json
import time

from inference_testkit import ByteTokenizer, make_context

from verst.rollout.engine import SamplingParams
from verst.rollout.generate import SingleTurnGenerate, generate_and_rm_group
from verst.rollout.lifecycle import EventKind, JsonlSink, LifecycleEvent
from verst.rollout.protocols import GenerateState
from verst.rollout.sample import Sample


class CountingTokenizer(ByteTokenizer):
    """The test kit's byte tokenizer, counting `encode` calls."""

    def __init__(self) -> None:
        self.encodes = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.encodes += 1
        return super().encode(text, add_special_tokens)


def group(text: str, n: int, start: int = 0) -> list[Sample]:
    return [Sample(prompt=text, label="x", group_index=0, sample_index=start + i) for i in range(n)]


async def run_groups(ctx, fn: SingleTurnGenerate, groups: list[list[Sample]]) -> list[list[Sample]]:
    state = GenerateState(
        context=ctx, rollout_id=0, weight_version=0, semaphore=asyncio.Semaphore(64), generate_fn=fn
    )
    return await asyncio.gather(*(generate_and_rm_group(state, g, SamplingParams()) for g in groups))


async def test_prompt_tokenised_once_per_distinct_prompt_and_tokenizer():
    ctx = make_context()
    tok = CountingTokenizer()
    ctx.tokenizer = tok
    fn = SingleTurnGenerate()
    done = await run_groups(ctx, fn, [group("hello", 8), group("world", 8, 8), group("hello", 4, 16)])
    assert tok.encodes == 2
    for g, text in zip(done, ["hello", "world", "hello"], strict=True):
        for s in g:
            assert s.tokens[: s.prompt_length] == [ord(c) for c in text]
    done[0][0].tokens[0] = -1  # samples own their token lists: the cache is not aliased
    again = await run_groups(ctx, fn, [group("hello", 2)])
    assert again[0][0].tokens[:5] == [ord(c) for c in "hello"] and tok.encodes == 2
    other = CountingTokenizer()  # a new tokenizer object: nothing reused from the old one
    ctx.tokenizer = other
    await run_groups(ctx, fn, [group("hello", 3)])
    assert other.encodes == 1


async def test_prompt_cache_is_bounded_and_chat_template_keyed():
    ctx = make_context(data={"apply_chat_template": True})
    tok = CountingTokenizer()
    ctx.tokenizer = tok
    fn = SingleTurnGenerate()
    fn.prompt_cache_size = 2
    await run_groups(ctx, fn, [group(t, 2) for t in ("a", "b", "c")])
    assert tok.encodes == 3 and len(fn._prompt_ids) == 2
    s = (await run_groups(ctx, fn, [group("c", 1)]))[0][0]
    assert tok.encodes == 3 and s.tokens[: s.prompt_length] == [ord(c) for c in "<user>c<assistant>"]


def event(i: int) -> LifecycleEvent:
    return LifecycleEvent(EventKind.GEN_END, 1, 0, i, 0, {"status": "completed"})


def lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_jsonl_sink_lines_arrive_within_the_flush_interval(tmp_path):
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path, flush_interval_s=0.05)
    for i in range(100):
        sink.emit(event(i))
    deadline = time.monotonic() + 5
    while len(lines(path)) < 100 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [e["sample_index"] for e in lines(path)] == list(range(100))  # no close needed
    sink.emit(event(100))
    sink.close()  # flushes what is left and stops the timer
    assert len(lines(path)) == 101
    sink.emit(event(101))  # after close: ignored, no error
    assert len(lines(path)) == 101


def test_jsonl_sink_unbuffered_writes_each_line_at_once(tmp_path):
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path, flush_interval_s=0)
    sink.emit(event(0))
    assert len(lines(path)) == 1
    sink.close()


def test_jsonl_sink_line_format_is_json_dumps_with_str_fallback(tmp_path):
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path)
    ev = LifecycleEvent(EventKind.ATTEMPT_END, 2, 1, 7, 3, {"where": tmp_path, "n": 1})
    sink.emit(ev)
    sink.close()
    assert path.read_text() == json.dumps(ev.to_dict(), default=str) + "\n"
