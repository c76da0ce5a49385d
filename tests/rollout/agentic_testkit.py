"""Deterministic pieces for the agentic tests.

`ScriptEngine` is an `InferenceEngine` whose "model" replies with scripted text per turn (a
function of the decoded conversation so far): the loop's behaviour on malformed calls, raising
or slow tools and limits is tested against exact, known model turns. Token ids are the
`ByteTokenizer`'s; log-probs are a fixed function of the position so alignment is checkable.
Tests of real generation (log-prob agreement, training) use the embedded engine instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from inference_testkit import ByteTokenizer, FakeEngineBase, ListDataSource

from verst.rollout.config import RolloutConfig
from verst.rollout.engine import GenerateOutput, GenerateRequest
from verst.rollout.lifecycle import ListSink
from verst.rollout.protocols import RolloutContext

TOKENIZER = ByteTokenizer()


class ScriptEngine(FakeEngineBase):
    """Replies `reply(conversation_text, request)` after `delay_s` (a number, or a function of the
    conversation and request); `abort` cuts a delayed reply to half its text (finish `abort`)."""

    def __init__(
        self,
        reply: Callable[[str, GenerateRequest], str],
        *,
        delay_s: float | Callable[[str, GenerateRequest], float] = 0.0,
        weight_version: int = 0,
    ) -> None:
        super().__init__(weight_version)
        self.reply = reply
        self.delay_s = delay_s
        self.requests: list[GenerateRequest] = []
        self.outputs: list[GenerateOutput] = []
        self.active = 0
        self.max_active = 0

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self.requests.append(request)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            text = self.reply(TOKENIZER.decode(request.input_ids), request)
            finish = "stop"
            if len(text) > request.sampling.max_new_tokens:
                text, finish = text[: request.sampling.max_new_tokens], "length"
            conv = TOKENIZER.decode(request.input_ids)
            delay = self.delay_s(conv, request) if callable(self.delay_s) else self.delay_s
            if delay:
                event = self._running.setdefault(request.rid, asyncio.Event())
                try:
                    await asyncio.wait_for(event.wait(), delay)
                    text, finish = text[: len(text) // 2], "abort"
                except TimeoutError:
                    pass
                finally:
                    self._running.pop(request.rid, None)
            ids = TOKENIZER.encode(text)
            start = len(request.input_ids)
            out = GenerateOutput(
                output_ids=ids,
                output_logprobs=[-0.01 * (start + i + 1) for i in range(len(ids))],
                finish_reason=finish,  # type: ignore[arg-type]
                weight_version=self.weight_version,
                prompt_tokens=len(request.input_ids),
                text=text,
            )
            self.outputs.append(out)
            return out
        finally:
            self.active -= 1


def call(name: str, **arguments: Any) -> str:
    """The text of one tool call."""
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def context(
    engine: Any, *, prompts: list[str], labels: list[Any] | None = None, reward_fn: Any = None, **config: Any
) -> RolloutContext:
    """A rollout context over `engine` with a ByteTokenizer, list data and a ListSink."""
    cfg = RolloutConfig(**{"batch_size": 1, "n_samples_per_prompt": 1, "max_response_len": 200, **config})
    return RolloutContext(
        config=cfg,
        data_source=ListDataSource(prompts, cfg.n_samples_per_prompt, labels),
        engine=engine,
        tokenizer=TOKENIZER,
        reward_fn=reward_fn,
        sink=ListSink(),
    )


def assert_episode_streams(events: list[Any]) -> dict[int | None, list[str]]:
    """Per sample: one attempt, `turn_start`/`turn_end` paired in order inside it (turn indices
    0, 1, ...), `tool_start`/`tool_end` paired inside a turn; returns the kinds per sample."""
    streams: dict[int | None, list[Any]] = {}
    for e in events:
        streams.setdefault(e.sample_index, []).append(e)
    out = {}
    for idx, evs in streams.items():
        kinds = [e.kind.value for e in evs]
        assert kinds[:2] == ["attempt_start", "gen_start"] and kinds[-1] == "attempt_end", (idx, kinds)
        assert kinds.count("attempt_start") == kinds.count("attempt_end") == 1, (idx, kinds)
        turn, tool = None, None
        expected_turn = 0
        for e in evs[2:-1]:
            k = e.kind.value
            if k == "turn_start":
                assert turn is None and e.detail["turn"] == expected_turn, (idx, kinds)
                turn = e.detail["turn"]
            elif k == "turn_end":
                assert turn == e.detail["turn"] and tool is None, (idx, kinds)
                assert e.detail["duration_s"] >= 0 and "status" in e.detail
                turn, expected_turn = None, expected_turn + 1
            elif k == "tool_start":
                assert turn is not None and tool is None and e.detail["turn"] == turn, (idx, kinds)
                tool = e.detail["tool"]
            elif k == "tool_end":
                assert tool == e.detail["tool"] and e.detail["duration_s"] >= 0, (idx, kinds)
                tool = None
        assert turn is None and tool is None, (idx, kinds)
        out[idx] = kinds
    return out
