"""The OpenAI API of `verst serve`, driven by the real `openai` client over loopback HTTP, and
the in-process client over an embedded engine (same frontend, no socket).

The model is the tiny tool-calling chat model of `envs_testlib` (over-fitted on one
conversation), so greedy decoding gives a real tool-call round trip.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch
from envs_testlib import ADD_TOOL, CALL, QUESTION, serve_in_thread

from verst.rollout.engines.serve.server import make_parser


@pytest.fixture(scope="module")
def server(tool_model):
    """`verst serve`'s app (built from its own argument parser) on a loopback port, in a thread."""
    args = ["--model", str(tool_model), "--tool-call-parser", "hermes", "--served-model-name", "tiny-tools"]
    with serve_in_thread(vars(make_parser().parse_args(args))) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def hf(tool_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tool_model).eval(), AutoTokenizer.from_pretrained(tool_model)


def _logprobs_of(model, prompt_ids, output_ids):
    """Reference log-probs of `output_ids` after `prompt_ids` (one forward pass, temperature 1)."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(output_ids)[:, None])[:, 0].tolist()


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == ["tiny-tools"]


def test_completions_text_ids_and_logprobs(client, hf):
    model, tok = hf
    r = client.completions.create(
        model="tiny-tools",
        prompt=f"user: {QUESTION}\n",
        max_tokens=6,
        temperature=0,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )
    choice = r.choices[0]
    assert choice.prompt_token_ids == tok.encode(f"user: {QUESTION}\n")
    assert len(choice.token_ids) == r.usage.completion_tokens == len(choice.logprobs.token_logprobs)
    assert choice.text == tok.decode(choice.token_ids, skip_special_tokens=True)
    ref = _logprobs_of(model, choice.prompt_token_ids, choice.token_ids)
    assert choice.logprobs.token_logprobs == pytest.approx(ref, abs=1e-4)
    assert all(len(t) == 2 for t in choice.logprobs.top_logprobs)
    # greedy: the chosen token is the most likely one
    for lp, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs, strict=True):
        assert lp == pytest.approx(max(top.values()), abs=1e-5)
    # token-id prompts give the same greedy answer, and n>1 returns n choices
    r2 = client.completions.create(
        model="x", prompt=choice.prompt_token_ids, max_tokens=6, temperature=0, n=2
    )
    assert [c.text for c in r2.choices] == [choice.text, choice.text]


def test_chat_tool_call_round_trip_with_exact_ids_and_logprobs(client, hf):
    model, tok = hf
    messages = [{"role": "user", "content": QUESTION}]
    r = client.chat.completions.create(
        model="tiny-tools",
        messages=messages,
        tools=[ADD_TOOL],
        temperature=0,
        max_tokens=80,
        logprobs=True,
        top_logprobs=1,
        extra_body={"return_token_ids": True},
    )
    choice = r.choices[0]
    # the server applied the chat template, tools included
    rendered = tok.apply_chat_template(messages, tools=[ADD_TOOL], add_generation_prompt=True, tokenize=False)
    assert choice.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    assert "tools: add" in tok.decode(choice.prompt_token_ids)
    # the tool call was parsed
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == CALL["arguments"]
    # the generated ids and their log-probs are the engine's, EOS included
    ids = choice.response_token_ids
    assert ids[-1] == tok.eos_token_id
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(
        _logprobs_of(model, choice.prompt_token_ids, ids), abs=1e-4
    )
    # the second turn: the tool's result goes back, the model answers
    messages += [
        {"role": "assistant", "content": choice.message.content, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    r2 = client.chat.completions.create(
        model="tiny-tools",
        messages=messages,
        tools=[ADD_TOOL],
        temperature=0,
        max_tokens=10,
        extra_body={"return_token_ids": True},
    )
    final = r2.choices[0]
    assert final.finish_reason == "stop" and final.message.content == "5" and not final.message.tool_calls
    # the second prompt extends the first turn exactly (prompt + generated ids are its prefix)
    assert final.prompt_token_ids[: len(choice.prompt_token_ids) + len(ids)] == choice.prompt_token_ids + ids


@pytest.mark.parametrize(
    ("endpoint", "body", "fragment"),
    [
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream=true"),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text-only model"),
        ("completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ("completions", {"prompt": "x" * 300}, "maximum context length"),
        ("completions", {"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        # #25 item 8: the engine's refusal (InvalidRequest) was a 503 the openai client retries
        ("completions", {"prompt": [99999]}, "input_ids must be ints"),
        ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "role 'wizard' is not one of"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools[0] needs a 'function' object",
        ),
    ],
)
def test_bad_requests_get_4xx_json(client, endpoint, body, fragment):
    create = client.chat.completions.create if endpoint == "chat" else client.completions.create
    with pytest.raises(openai.BadRequestError) as info:
        create(model="tiny-tools", **body)
    assert info.value.status_code == 400
    err = info.value.body
    assert err["object"] == "error" and err["code"] == 400 and fragment in err["message"]


def test_malformed_json_is_a_400(server):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"{server}/v1/chat/completions", data=b"{nope", method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == 400
    assert json.loads(info.value.read())["type"] == "BadRequestError"


async def test_in_process_client_records_exact_tokens(tool_model):
    from verst.rollout.engines.embedded.engine import EmbeddedEngine
    from verst.rollout.engines.serve.inprocess_openai import InProcessOpenAI

    engine = EmbeddedEngine.from_pretrained(tool_model, num_threads=1)
    oai = InProcessOpenAI(engine, tool_call_parser="hermes")
    try:
        assert isinstance(oai.client, openai.AsyncOpenAI)
        r = await oai.client.chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": QUESTION}],
            tools=[ADD_TOOL],
            temperature=0,
            max_tokens=80,
        )
        assert r.choices[0].message.tool_calls[0].function.name == "add"
        (call,) = oai.take_calls()
        tok = engine.tokenizer
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": QUESTION}],
            tools=[ADD_TOOL],
            add_generation_prompt=True,
            tokenize=False,
        )
        assert call.prompt_ids == tok.encode(rendered, add_special_tokens=False)
        assert call.output_ids[-1] == tok.eos_token_id
        assert len(call.output_logprobs) == len(call.output_ids) == r.usage.completion_tokens
        assert call.finish_reason == "stop" and call.endpoint == "chat.completions"
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            await oai.client.completions.create(model="any", prompt="x" * 300)
        assert oai.calls == []
    finally:
        await oai.close()
        await engine.close()
