"""A tiny chat model that calls a tool, built (and over-fitted) by the tests themselves.

The char tokenizer gets a chat template that renders `tools`, assistant `tool_calls` (as
`<tool_call>{json}</tool_call>`, the hermes/qwen25 format) and `tool` messages. The tiny Llama
is trained for a few seconds on one conversation, so greedy decoding reproduces it:

    user: add 2 and 3            → assistant: <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>
    tool: 5                      → assistant: 5

That is enough to drive a real tool-call round trip through the OpenAI API and the adapters.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path

from verst.rollout.toy import CHARS, build_char_tokenizer, build_tiny_llama

TOOL_TEMPLATE = (
    "{%- set NL = '\\n' -%}"
    "{%- if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}{{ NL }}{% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' %}system: {{ m['content'] }}{{ NL }}"
    "{%- elif m['role'] == 'user' %}user: {{ m['content'] }}{{ NL }}"
    "{%- elif m['role'] == 'assistant' %}assistant: {{ m['content'] or '' }}"
    "{%- for c in m['tool_calls'] or [] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>"
    "{%- endfor %}{{ eos_token }}{{ NL }}"
    "{%- elif m['role'] == 'tool' %}tool: {{ m['content'] }}{{ NL }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt %}assistant: {% endif -%}"
)

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
QUESTION = "add 2 and 3"
CALL = {"name": "add", "arguments": {"a": 2, "b": 3}}


def conversation() -> list[dict]:
    """The conversation the model learns (assistant call, tool result, final answer)."""
    call = {
        "id": "c0",
        "type": "function",
        "function": {"name": "add", "arguments": json.dumps(CALL["arguments"])},
    }
    return [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c0", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]


def make_tool_model(path: Path, steps: int = 220, seed: int = 0) -> Path:
    """Save the tokenizer (with `TOOL_TEMPLATE`) and a tiny Llama over-fitted on `conversation()`."""
    import torch

    tok = build_char_tokenizer(CHARS + "_")
    tok.chat_template = TOOL_TEMPLATE
    model = build_tiny_llama(
        len(tok),
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        seed=seed,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    from verst.rollout.engines.serve.openai_protocol import template_messages

    ids = tok.apply_chat_template(
        template_messages(conversation()), tools=[ADD_TOOL], tokenize=True, return_dict=False
    )
    x = torch.tensor([ids])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: a loaded 2-core box stalls multi-threaded tiny ops
    try:
        model.train()
        for _ in range(steps):
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            if loss.item() < 0.01:
                break
    finally:
        torch.set_num_threads(threads)
    model.eval()
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@contextlib.contextmanager
def serve_in_thread(info: dict) -> Iterator[str]:
    """`verst serve`'s aiohttp app for `info` (its parsed CLI arguments) on a free loopback port,
    run by an event loop in a background thread; yields the base URL."""
    from aiohttp import web

    from verst.rollout.engines.embedded.engine import EmbeddedEngine
    from verst.rollout.engines.serve.server import build_app
    from verst.rollout.engines.sglang.launcher import free_port

    engine = EmbeddedEngine.from_pretrained(info["model"], num_threads=1)
    loop = asyncio.new_event_loop()
    port = free_port()
    runner = web.AppRunner(build_app(engine, info=info))

    async def start() -> None:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


class RecordingEngine:
    """Delegates to a real engine and keeps every (input ids, output ids, log-probs) it served,
    so a test can check a trajectory against exactly what the engine saw and produced."""

    def __init__(self, engine):
        self.engine = engine
        self.tokenizer = getattr(engine, "tokenizer", None)
        self.calls: list[tuple[list[int], list[int], list[float]]] = []

    async def generate(self, request):
        out = await self.engine.generate(request)
        self.calls.append((list(request.input_ids), list(out.output_ids), list(out.output_logprobs)))
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


def assert_exact_trajectory(sample, calls) -> int:
    """Every model segment of `sample` is one engine call: its prompt is exactly the sample's
    tokens before the segment and its output the segment's ids (log-probs too); env segments
    are loss-masked; returns the number of model turns."""
    from verst.rollout.agentic import segments_of

    by_prompt = {tuple(i): (o, lp) for i, o, lp in calls}
    turns = 0
    for seg in segments_of(sample):
        start = sample.prompt_length + seg["start"]
        ids = sample.tokens[start : start + seg["length"]]
        if seg["source"] != "model":
            assert sample.loss_mask[seg["start"] : seg["start"] + seg["length"]] == [0] * seg["length"]
            continue
        out, lps = by_prompt[tuple(sample.tokens[:start])]
        assert ids == out
        got = sample.rollout_logprobs[seg["start"] : seg["start"] + seg["length"]]
        # identical prompts decoded in one batch may differ in the last float bits
        assert (
            len(got) == len(lps)
            and max((abs(a - b) for a, b in zip(got, lps, strict=True)), default=0) < 1e-4
        )
        turns += 1
    return turns


def lifecycle_closed(events) -> None:
    """Every attempt and every turn that started also ended."""
    kinds = [e.kind.value for e in events]
    assert kinds.count("attempt_start") == kinds.count("attempt_end") > 0
    assert kinds.count("turn_start") == kinds.count("turn_end") > 0


async def run_rollout(engine, tokenizer, data_source, env: dict, **config):
    """One rollout of the default strategy over `env` ([rollout.env] as a dict); returns
    (result, strategy, sink)."""
    from verst.rollout.config import RolloutConfig
    from verst.rollout.lifecycle import ListSink
    from verst.rollout.protocols import RolloutContext, RolloutRequest
    from verst.rollout.strategies.inference import InferenceRollout

    cfg = RolloutConfig(
        **{
            "batch_size": 1,
            "n_samples_per_prompt": 2,
            "max_response_len": 80,
            "temperature": 0.0,
            "max_group_retries": 0,
            "env": env,
            **config,
        }
    )
    sink = ListSink()
    ctx = RolloutContext(
        config=cfg, data_source=data_source, engine=engine, tokenizer=tokenizer, reward_fn=None, sink=sink
    )
    strategy = InferenceRollout(ctx)
    try:
        result = await strategy(RolloutRequest(0))
    finally:
        await strategy.close()
    return result, strategy, sink
