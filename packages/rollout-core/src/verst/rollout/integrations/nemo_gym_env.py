"""A NeMo Gym resources server mapped onto verst's `Environment` protocol, over its HTTP API.

    [rollout.data]                          # NeMo Gym's task rows (one JSON object per line)
    source = "nemo_gym"
    [rollout.data.options]
    path = "data/example.jsonl"             # {"responses_create_params": {"input": [...], "tools": [...]}, ...}

    [rollout.env]
    type = "nemo_gym"
    max_turns = 4
    [rollout.env.options]
    resources_server_url = "http://127.0.0.1:8001"

verst plays NeMo Gym's agent (the `simple_agent` flow) and generates the model's turns itself:
per episode it opens an HTTP session with its own cookie jar, `POST /seed_session` with the task
row; the row's `responses_create_params.input` (Responses-API messages, `developer` → `system`)
and `tools` (converted to chat-completions function schemas) are the first observation,
rendered by the chat template with `tools=`; each tool call the model writes
(`<tool_call>{"name", "arguments"}</tool_call>`) is `POST /<name>` with the arguments, and the
raw response body is the tool message; a turn without tool calls is the final answer: verst
builds the Responses-API `response` (`function_call`, `function_call_output` and `message` output
items), `POST /verify` with `row | {"response": ...}`, and the returned `reward` is the
episode's reward (the rest of the verify response goes to `env_info`).

NeMo Gym itself is not imported (it cannot be installed next to this project's lock: every
release needs Python >= 3.12, and its pins of `openai` conflict with sglang's); the resources
server runs in its own environment and only its HTTP API is used. A 4xx/5xx answer, a timeout
(`timeout_s`), a connection failure or a verify response without a numeric `reward` is an
`EnvFailure`.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from verst.rollout.agentic.environment import EnvironmentFactory, EnvSetup, ModelTurn, Observation, StepResult
from verst.rollout.errors import DataError
from verst.rollout.integrations._common import EnvFailure, LoadedSource, assistant_message
from verst.rollout.sample import Sample, Status


def chat_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Responses-API input messages → chat messages (text content; `developer` → `system`)."""
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or "role" not in item:
            raise DataError(f"responses_create_params.input[{i}] is not a message with a role: {item!r:.100}")
        content = item.get("content", "")
        if isinstance(content, list):
            parts = [
                p.get("text", "")
                for p in content
                if isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
            ]
            if len(parts) != len(content):
                raise DataError(f"responses_create_params.input[{i}]: only text content is supported")
            content = "".join(parts)
        role = "system" if item["role"] == "developer" else item["role"]
        out.append({"role": role, "content": content})
    return out


def chat_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Responses-API function tools → chat-completions tool schemas."""
    out = []
    for t in tools:
        if not isinstance(t, dict) or t.get("type") != "function":
            raise DataError(f"only function tools are supported, got {t!r:.100}")
        fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
        out.append({"type": "function", "function": fn})
    return out


class NemoGymSource(LoadedSource):
    """NeMo Gym task rows (JSONL) as verst prompts; each sample's `label` is its row."""

    class Config(BaseModel):
        """`rollout.data.options` of `source = "nemo_gym"`."""

        model_config = ConfigDict(extra="forbid")

        path: str = Field(
            description="JSONL file of NeMo Gym rows (responses_create_params + verifier fields)."
        )
        shuffle: bool = Field(True, description="Shuffle every epoch.")
        seed: int = Field(0, description="Seed of the shuffle.")

    options: Config

    def _rows(self) -> list[Sample]:
        path = Path(self.options.path)
        if not path.is_file():
            raise DataError(f"{path}: no such file; fix: check rollout.data.options.path")
        samples = []
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                params = row["responses_create_params"]
                prompt = chat_messages(params["input"])
            except (json.JSONDecodeError, KeyError, TypeError, DataError) as exc:
                raise DataError(
                    f"{path}:{lineno}: not a NeMo Gym row ({type(exc).__name__}: {exc}); fix: each line needs "
                    '{"responses_create_params": {"input": [{"role": ..., "content": ...}]}, ...}'
                ) from None
            samples.append(Sample(prompt=prompt, label=row, metadata={}, status=Status.PENDING))
        return samples


class NemoGymOptions(BaseModel):
    """`rollout.env.options` of `type = "nemo_gym"`."""

    model_config = ConfigDict(extra="forbid")

    resources_server_url: str = Field(description="Base URL of the NeMo Gym resources server.")
    timeout_s: float = Field(30.0, gt=0, description="Timeout of one HTTP call (seed, tool, verify).")
    model_name: str = Field("verst", description="The `model` of the Responses-API response sent to /verify.")


class NemoGymEnvironment:
    """One NeMo Gym episode (see the module docstring)."""

    Config = NemoGymOptions

    def __init__(self, options: NemoGymOptions) -> None:
        self.options = options
        self.http: Any = None
        self.row: dict[str, Any] = {}
        self.tools: list[dict[str, Any]] = []
        self.output: list[dict[str, Any]] = []

    @classmethod
    def factory(cls, options: NemoGymOptions, setup: EnvSetup) -> EnvironmentFactory:
        return lambda: cls(options)

    async def _post(self, path: str, body: Any) -> tuple[str, Any]:

        import aiohttp

        url = self.options.resources_server_url.rstrip("/") + path
        try:
            async with self.http.post(url, json=body) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise EnvFailure(
                        "nemo_gym", "http_error", f"POST {path} answered {resp.status}: {text[:300]}"
                    )
                return text, resp
        except TimeoutError as exc:
            raise EnvFailure(
                "nemo_gym", "timeout", f"POST {path} timed out after {self.options.timeout_s}s"
            ) from exc
        except aiohttp.ClientError as exc:
            raise EnvFailure("nemo_gym", "http_error", f"POST {path}: {type(exc).__name__}: {exc}") from exc

    async def reset(self, sample: Sample) -> Observation:
        import aiohttp

        if not (isinstance(sample.label, dict) and "responses_create_params" in sample.label):
            raise EnvFailure(
                "nemo_gym",
                "malformed",
                "the sample's label is not a NeMo Gym row; use rollout.data.source = 'nemo_gym'",
            )
        self.row = sample.label
        params = self.row["responses_create_params"]
        self.tools = list(params.get("tools") or [])
        timeout = aiohttp.ClientTimeout(total=self.options.timeout_s)
        self.http = aiohttp.ClientSession(timeout=timeout, cookie_jar=aiohttp.CookieJar(unsafe=True))
        await self._post("/seed_session", self.row)
        return Observation(
            messages=tuple(chat_messages(params["input"])), tools=tuple(chat_tools(self.tools))
        )

    async def step(self, turn: ModelTurn) -> StepResult:
        message = assistant_message(turn.text, chat_tools(self.tools), True)
        calls = message.get("tool_calls") or []
        if not calls:
            self.output.append(
                {
                    "id": f"msg_{uuid.uuid4().hex[:16]}",
                    "type": "message",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": message["content"], "annotations": []}],
                }
            )
            return await self._verify()
        replies = []
        for call in calls:
            fn = call["function"]
            self.output.append(
                {
                    "type": "function_call",
                    "call_id": call["id"],
                    "name": fn["name"],
                    "arguments": fn["arguments"],
                    "id": f"fc_{uuid.uuid4().hex[:16]}",
                    "status": "completed",
                }
            )
            text, _ = await self._post(f"/{fn['name']}", json.loads(fn["arguments"] or "{}"))
            self.output.append({"type": "function_call_output", "call_id": call["id"], "output": text})
            replies.append({"role": "tool", "tool_call_id": call["id"], "content": text})
        return StepResult(
            observation=Observation(messages=tuple(replies)), metrics={"tool_calls": float(len(calls))}
        )

    def response(self) -> dict[str, Any]:
        """The Responses-API object of the episode so far (what /verify receives)."""
        params = self.row.get("responses_create_params", {})
        return {
            "id": f"resp_{uuid.uuid4().hex}",
            "object": "response",
            "created_at": float(int(time.time())),
            "model": self.options.model_name,
            "output": list(self.output),
            "parallel_tool_calls": bool(params.get("parallel_tool_calls", True)),
            "tool_choice": params.get("tool_choice", "auto"),
            "tools": self.tools,
            "status": "completed",
        }

    async def _verify(self) -> StepResult:
        text, _ = await self._post("/verify", {**self.row, "response": self.response()})
        try:
            result = json.loads(text)
            reward = float(result["reward"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise EnvFailure(
                "nemo_gym", "malformed", f"/verify gave no numeric reward ({exc}): {text[:200]}"
            ) from None
        info = {k: v for k, v in result.items() if k not in ("response", "responses_create_params", "reward")}
        return StepResult(reward=reward, done=True, info={"nemo_gym": info})

    async def close(self) -> None:
        if self.http is not None:
            http, self.http = self.http, None
            await http.close()
