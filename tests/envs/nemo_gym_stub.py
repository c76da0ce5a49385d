"""A minimal in-repo implementation of NeMo Gym's resources-server HTTP interface, for the
adapter test only: NeMo Gym cannot be installed next to this project's lock (every release needs
Python >= 3.12; its `openai` pins conflict with sglang's), so, per the issue's fallback rule, the
adapter is tested against this stand-in of the published interface, modelled on the package's
`resources_servers/example_single_tool_call` and `responses_api_agents/simple_agent`:

- `POST /seed_session` (the task row) → `{}` and a session cookie;
- `POST /<tool>` (the call's arguments) → the tool's JSON result; needs the session cookie;
- `POST /verify` (`row | {"response": <Responses-API object>}`) → `row | response | {"reward"}`;
  the response is validated as NeMo Gym's `NeMoGymResponse` is: `openai.types.responses.Response`
  with `output` items that may also be `function_call_output` (422 when it does not validate).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Annotated, Literal

from aiohttp import web
from openai.types.responses import Response, ResponseFunctionToolCall, ResponseOutputMessage
from pydantic import BaseModel, Field


class FunctionCallOutput(BaseModel):
    """NeMo Gym's `NeMoGymFunctionCallOutput` (a tool result kept in the response's output)."""

    call_id: str
    output: str
    type: Literal["function_call_output"] = "function_call_output"
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


OutputItem = Annotated[
    ResponseOutputMessage | ResponseFunctionToolCall | FunctionCallOutput, Field(discriminator="type")
]


class GymResponse(Response):
    """NeMo Gym's `NeMoGymResponse`: an OpenAI Responses object whose output may hold tool results."""

    output: list[OutputItem]  # type: ignore[assignment]


def build_app(tool_delay_s: float = 0.0) -> web.Application:
    sessions: dict[str, dict] = {}

    def session_of(request: web.Request) -> dict:
        sid = request.cookies.get("nemo_gym_session")
        if sid not in sessions:
            raise web.HTTPBadRequest(text="no seeded session (missing cookie)")
        return sessions[sid]

    async def seed_session(request: web.Request) -> web.Response:
        body = await request.json()
        if "responses_create_params" not in body:
            raise web.HTTPUnprocessableEntity(text="responses_create_params is required")
        sid = uuid.uuid4().hex
        sessions[sid] = {"tool_calls": 0}
        resp = web.json_response({})
        resp.set_cookie("nemo_gym_session", sid)
        return resp

    async def add(request: web.Request) -> web.Response:
        state = session_of(request)
        body = await request.json()
        await asyncio.sleep(tool_delay_s)
        state["tool_calls"] += 1
        return web.json_response(int(body["a"]) + int(body["b"]))

    async def verify(request: web.Request) -> web.Response:
        from pydantic import ValidationError

        state = session_of(request)
        body = await request.json()
        if body.get("fail_verify"):
            raise web.HTTPInternalServerError(text="the judge is unavailable")
        try:
            response = GymResponse.model_validate(body["response"])
        except (KeyError, ValidationError) as exc:
            raise web.HTTPUnprocessableEntity(text=f"invalid response: {exc}") from None
        called = any(item.type == "function_call" and item.name == "add" for item in response.output)
        answer = response.output_text.strip()
        reward = float(called and answer == body["expected_answer"])
        return web.json_response({**body, "reward": reward, "tool_calls_seen": state["tool_calls"]})

    app = web.Application()
    app.router.add_post("/seed_session", seed_session)
    app.router.add_post("/add", add)
    app.router.add_post("/verify", verify)
    return app
