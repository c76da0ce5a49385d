"""`verst serve`'s OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions.

Registered on the server app by `register_openai_routes` (one call in `server.build_app`); the
logic is `openai_protocol.OpenAIFrontend`, shared with the in-process client. Errors are JSON
with SGLang's shape, `{"object": "error", "message", "type", "param", "code"}`, and a 4xx for
the caller's mistakes (bad JSON, invalid fields, unsupported values, an overlong prompt).

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:30000/v1", api_key="none")
    r = client.chat.completions.create(model="m", messages=[...], logprobs=True,
                                       extra_body={"return_token_ids": True})
    r.choices[0].prompt_token_ids, r.choices[0].response_token_ids   # the exact ids
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from verst.rollout.engines.serve.openai_protocol import OpenAIError, OpenAIFrontend

log = logging.getLogger("verst.serve.openai")
FRONTEND = web.AppKey("verst_openai_frontend", OpenAIFrontend)


def _error(exc: OpenAIError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


def _endpoint(
    call: Callable[[OpenAIFrontend, Any], Awaitable[dict[str, Any]]],
) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        try:
            raw = await request.read()
            try:
                body = json.loads(raw) if raw else None
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise OpenAIError(f"malformed JSON body: {exc}") from None
            return web.json_response(await call(request.app[FRONTEND], body))
        except OpenAIError as exc:
            return _error(exc)
        except Exception as exc:  # a bug: report it as JSON, keep serving
            log.exception("unhandled error in %s", request.path)
            return _error(OpenAIError(f"{type(exc).__name__}: {exc}", status=500, type="InternalServerError"))

    return handler


async def _models(request: web.Request) -> web.Response:
    return web.json_response(request.app[FRONTEND].models())


def register_openai_routes(
    app: web.Application,
    engine: Any,
    *,
    model_name: str | None = None,
    tool_call_parser: str | None = None,
) -> OpenAIFrontend:
    """Add the OpenAI API over `engine` (its own tokenizer) to `app`; returns the frontend."""
    frontend = OpenAIFrontend(engine, model_name=model_name, tool_call_parser=tool_call_parser)
    app[FRONTEND] = frontend
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", _endpoint(lambda f, b: f.completions(b)))
    app.router.add_post("/v1/chat/completions", _endpoint(lambda f, b: f.chat(b)))
    return frontend
