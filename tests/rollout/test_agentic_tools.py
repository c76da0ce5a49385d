"""The built-in tool environment, through the real episode loop and the default strategy.

Model turns are scripted (`ScriptEngine`), so each test knows exactly what the model wrote: a
good call, a tool that raises, a tool that sleeps past its timeout, malformed call text, an
unknown tool — each must become an error observation that is counted, never a crash or a hang,
with the lifecycle events of the turn and the tool call.
"""

from __future__ import annotations

import asyncio
import time
from typing import Literal

import pytest
from agentic_testkit import ScriptEngine, assert_episode_streams, call, context
from inference_testkit import ByteTokenizer

from verst.rollout.agentic.tools import ToolEnvironment, parse_tool_calls, tool_schema
from verst.rollout.lifecycle import EventKind
from verst.rollout.protocols import RolloutRequest
from verst.rollout.strategies.inference import InferenceRollout


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second
            factor, on two lines.
    """
    return a * b


async def lookup(key: str, table: Literal["x", "y"] = "x", limit: int | None = None) -> str:
    """Look a key up.

    :param key: what to look up.
    """
    return f"{table}:{key}"


def explode(n: int) -> int:
    """Always raises."""
    raise ValueError(f"cannot handle {n}")


async def slow(n: int) -> int:
    """Sleeps far past its timeout."""
    await asyncio.sleep(30)
    return n


def test_schema_comes_from_signature_and_docstring():
    fn = tool_schema(multiply)["function"]
    assert fn["name"] == "multiply" and fn["description"] == "Multiply two integers."
    assert fn["parameters"] == {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "description": "the first factor."},
            "b": {"type": "integer", "description": "the second factor, on two lines."},
        },
        "required": ["a", "b"],
    }
    props = tool_schema(lookup)["function"]["parameters"]["properties"]
    assert props["key"] == {"type": "string", "description": "what to look up."}
    assert props["table"] == {"enum": ["x", "y"], "default": "x"}
    assert props["limit"] == {"type": "integer", "default": None}


def test_parse_tool_calls_reports_each_malformed_call():
    calls = parse_tool_calls(
        call("multiply", a=1, b=2) + "<tool_call>{not json}</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "m", "arguments": 3}</tool_call><tool_call>'
    )
    assert calls[0].name == "multiply" and calls[0].arguments == {"a": 1, "b": 2} and calls[0].error is None
    assert "invalid JSON" in calls[1].error
    assert "expected" in calls[2].error
    assert "arguments must be an object" in calls[3].error
    assert "without </tool_call>" in calls[4].error
    assert parse_tool_calls("no call here") == []


def _run(first_turn: str, *, tools=(multiply,), rounds: int = 1, tokenizer=None, **env):
    """One episode: the model writes `first_turn` `rounds` times, then answers 'done'."""

    def reply(conv: str, req) -> str:
        return first_turn if conv.count("</tool_call>") < rounds else "done"

    engine = ScriptEngine(reply)
    options = env.pop("options", {})
    ctx = context(engine, prompts=["q:"], env={"type": "tools", **env, "options": options})
    if tokenizer is not None:
        ctx.tokenizer = tokenizer
    strategy = InferenceRollout(ctx)
    base = strategy.generate_fn.factory
    strategy.generate_fn.factory = lambda: ToolEnvironment(tools, base().config)
    result = asyncio.run(strategy(RolloutRequest(0)))
    assert_episode_streams(ctx.sink.events)  # every path: one attempt, turn/tool spans nested
    return result.groups[0][0], result.metrics, ctx.sink.events


def _kinds(events):
    return [e.kind.value for e in events]


def test_a_good_call_returns_the_result_as_an_observation():
    sample, metrics, events = _run(call("multiply", a=12, b=34))
    assert "<tool_response>408</tool_response>done" in sample.response
    assert sample.metadata["termination"] == "stop"
    assert metrics["rollout/env/tool_calls"] == 1 and metrics["rollout/env/tool_errors"] == 0
    assert metrics["rollout/turns_mean"] == 2
    assert _kinds(events) == [
        "attempt_start", "gen_start",
        "turn_start", "tool_start", "tool_end", "turn_end",
        "turn_start", "turn_end",
        "gen_end", "attempt_end",
    ]  # fmt: skip
    tool_end = next(e for e in events if e.kind is EventKind.TOOL_END)
    assert tool_end.detail["tool"] == "multiply" and tool_end.detail["status"] == "ok"
    assert tool_end.detail["turn"] == 0 and tool_end.detail["duration_s"] >= 0
    assert tool_end.detail["call_id"] == 0 and tool_end.detail["attempt"] == 0
    assert all(e.detail["attempt"] == 0 for e in events if e.kind.value.startswith(("turn", "tool")))
    assert tool_end.sample_index == sample.sample_index and tool_end.group_index == sample.group_index
    assert [e.detail["turn"] for e in events if e.kind is EventKind.TURN_END] == [0, 1]


def test_a_raising_tool_becomes_an_error_observation():
    sample, metrics, events = _run(call("explode", n=3), tools=(explode,))
    assert "<tool_response>error: ValueError: cannot handle 3</tool_response>" in sample.response
    assert sample.metadata["termination"] == "stop"
    assert metrics["rollout/env/tool_errors"] == 1
    end = next(e for e in events if e.kind is EventKind.TOOL_END)
    assert end.detail["status"] == "error" and end.detail["error"] == "ValueError"


def test_a_tool_past_its_timeout_is_an_error_not_a_hang():
    started = time.perf_counter()
    sample, metrics, events = _run(call("slow", n=1), tools=(slow,), options={"tool_timeout_s": 0.2})
    assert time.perf_counter() - started < 5
    assert "timed out after 0.2s" in sample.response
    assert metrics["rollout/env/tool_timeouts"] == 1 and metrics["rollout/env/tool_errors"] == 1
    end = next(e for e in events if e.kind is EventKind.TOOL_END)
    assert end.detail["status"] == "timeout" and end.detail["duration_s"] >= 0.2


@pytest.mark.parametrize(
    ("text", "counter", "message"),
    [
        ("<tool_call>{oops</tool_call>", "malformed_calls", "invalid JSON"),
        (
            '<tool_call>{"name": "multiply", "arguments": {"a": 1}}</tool_call>',
            "tool_errors",
            "bad arguments",
        ),
        (call("divide", a=1, b=2), "unknown_tools", "unknown tool 'divide'; available tools: multiply"),
    ],
)
def test_malformed_or_unknown_calls_are_counted_error_observations(text, counter, message):
    sample, metrics, _ = _run(text)
    assert message in sample.response
    assert metrics[f"rollout/env/{counter}"] == 1
    assert sample.metadata["termination"] == "stop"
    sample.validate()


def test_max_tool_errors_ends_the_episode_with_tool_error():
    sample, metrics, _ = _run(
        call("explode", n=1), tools=(explode,), rounds=5, options={"max_tool_errors": 2}
    )
    assert sample.metadata["termination"] == "tool_error"
    assert metrics["rollout/termination/tool_error"] == 1.0
    assert sample.metadata["env_metrics"]["tool_errors"] == 2


def test_max_turns_ends_the_episode():
    sample, metrics, events = _run(call("multiply", a=1, b=1), rounds=10, max_turns=3)
    assert sample.metadata["termination"] == "max_turns"
    assert sample.status.value == "truncated"
    assert metrics["rollout/turns_max"] == 3
    assert sum(e.kind is EventKind.TURN_START for e in events) == 3
    assert sum(e.kind is EventKind.TURN_END for e in events) == 3


def test_max_tokens_ends_the_episode_within_the_budget():
    sample, metrics, _ = _run(call("multiply", a=1, b=1), rounds=10, max_tokens=150)
    assert sample.metadata["termination"] == "max_tokens"
    assert len(sample.tokens) <= 150
    assert metrics["rollout/termination/max_tokens"] == 1.0
    sample.validate()


class ChatByteTokenizer(ByteTokenizer):
    """ByteTokenizer with a chat template that honours `add_generation_prompt` and `tools=`."""

    chat_template = "<role>content per message"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, tools=None, **kw):
        head = f"<tools>{','.join(t['function']['name'] for t in tools)}" if tools else ""
        body = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return head + body + ("<assistant>" if add_generation_prompt else "")


def test_chat_template_mode_renders_prompt_with_tools_and_tool_messages():
    sample, _, _ = _run(
        call("multiply", a=2, b=3), options={"chat_template": True}, tokenizer=ChatByteTokenizer()
    )
    prompt = ChatByteTokenizer().decode(sample.tokens[: sample.prompt_length])
    assert prompt == "<tools>multiply<user>q:<assistant>"
    assert sample.response.endswith("</tool_call><tool>6<assistant>done")
    sample.validate()


def test_chat_prompts_use_the_chat_template_with_tools_by_default():
    engine = ScriptEngine(
        lambda conv, req: call("multiply", a=2, b=3) if "</tool_call>" not in conv else "ok"
    )
    ctx = context(engine, prompts=[], env={"type": "tools"})
    ctx.tokenizer = ChatByteTokenizer()
    ctx.data_source.prompts = [[{"role": "user", "content": "q:"}]]
    ctx.data_source.labels = [None]
    strategy = InferenceRollout(ctx)
    strategy.generate_fn.factory = lambda: ToolEnvironment([multiply])
    sample = asyncio.run(strategy(RolloutRequest(0))).groups[0][0]
    assert (
        ChatByteTokenizer().decode(sample.tokens[: sample.prompt_length])
        == "<tools>multiply<user>q:<assistant>"
    )
    assert sample.response.endswith("<tool>6<assistant>ok")
