"""An OpenAI async client backed directly by an `InferenceEngine`: no server, no socket.

For environment libraries that drive the model through an OpenAI client (verifiers, OpenEnv
agents, NeMo Gym agents): `InProcessOpenAI(engine).client` is a real `openai.AsyncOpenAI` whose
HTTP transport hands each request to the same `OpenAIFrontend` that `verst serve` uses, in this
process. Every generated choice is recorded in `calls` with its exact prompt ids, output ids and
log-probs, so the trajectory is assembled from the tokens the engine saw, never re-tokenised.

    oai = InProcessOpenAI(engine, tool_call_parser="hermes")
    r = await oai.client.chat.completions.create(model=oai.model_name, messages=[...])
    oai.calls[-1].prompt_ids, oai.calls[-1].output_ids, oai.calls[-1].output_logprobs

Needs the `openai` extra (`uv sync --extra openai`).
"""

from __future__ import annotations

import json
from typing import Any

from verst.rollout.engines.common.errors import require
from verst.rollout.engines.serve.openai_protocol import OpenAICall, OpenAIError, OpenAIFrontend

BASE_URL = "http://verst.in-process/v1"
"""The client's base URL; nothing listens there, requests never leave the process."""


def _transport_class() -> type:
    import httpx

    class EngineTransport(httpx.AsyncBaseTransport):
        """Routes `POST /v1/...` to an `OpenAIFrontend` (JSON in, JSON out, like a server)."""

        def __init__(self, frontend: OpenAIFrontend) -> None:
            self.frontend = frontend

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            path = request.url.path.removeprefix("/v1")
            try:
                raw = await request.aread()
                body = json.loads(raw) if raw else None
                if request.method == "GET" and path == "/models":
                    payload = self.frontend.models()
                elif request.method == "POST" and path == "/completions":
                    payload = await self.frontend.completions(body)
                elif request.method == "POST" and path == "/chat/completions":
                    payload = await self.frontend.chat(body)
                else:
                    raise OpenAIError(
                        f"{request.method} {request.url.path} is not served", status=404, type="NotFound"
                    )
            except OpenAIError as exc:
                return httpx.Response(exc.status, json=exc.body())
            except json.JSONDecodeError as exc:
                err = OpenAIError(f"malformed JSON body: {exc}")
                return httpx.Response(err.status, json=err.body())
            return httpx.Response(200, json=payload)

    return EngineTransport


class InProcessOpenAI:
    """An `openai.AsyncOpenAI` over `engine`, recording each call's exact tokens."""

    def __init__(self, engine: Any, tokenizer: Any = None, *, max_retries: int = 0, **frontend: Any) -> None:
        """`tokenizer` defaults to `engine.tokenizer` (needed for chat and text prompts);
        `frontend`: `OpenAIFrontend`'s options (`model_name`, `tool_call_parser` as `verst serve
        --tool-call-parser`, None = no tool-call parsing; `context_len`)."""
        require("openai", extra="openai", feature="the in-process OpenAI client")
        import httpx
        from openai import AsyncOpenAI

        self.calls: list[OpenAICall] = []
        """Every generated choice, in completion order."""
        self.frontend = OpenAIFrontend(engine, tokenizer, on_call=self.calls.append, **frontend)
        transport = _transport_class()(self.frontend)
        self.client = AsyncOpenAI(
            api_key="verst-in-process",
            base_url=BASE_URL,
            max_retries=max_retries,
            http_client=httpx.AsyncClient(transport=transport, base_url=BASE_URL),
        )
        """The `openai.AsyncOpenAI` to hand to a library."""

    @property
    def model_name(self) -> str:
        """The model id the frontend answers to (any id is accepted)."""
        return self.frontend.model_name

    def take_calls(self) -> list[OpenAICall]:
        """The calls recorded so far, clearing the record."""
        out = list(self.calls)
        self.calls.clear()
        return out

    async def close(self) -> None:
        """Close the client (the engine is the caller's)."""
        await self.client.close()
