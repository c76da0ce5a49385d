"""The OpenAI API's data on this side of the frontend: the request models of `/v1/completions`
and `/v1/chat/completions` (unknown keys ignored, unsupported values a 400 naming the key),
`OpenAIError`, the `OpenAICall` record of one generated choice, message templating and the
`<tool_call>` parser (`hermes` / `qwen25`). `OpenAIFrontend` (`openai_protocol`) uses them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

TOOL_CALL_PARSERS = ("hermes", "qwen25")
"""Names accepted by `tool_call_parser` (both read `<tool_call>{"name", "arguments"}</tool_call>`)."""

CHAT_ROLES = ("system", "user", "assistant", "tool", "function", "developer", "latest_reminder", "root")
"""The message roles of SGLang 0.5.23's chat-completions schema (case-insensitive, lowered as
SGLang does); any other role is a 400."""

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class OpenAIError(Exception):
    """A request the API refuses; `status` is the HTTP status (4xx for the caller's mistakes)."""

    def __init__(
        self, message: str, *, status: int = 400, type: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.type, self.param = status, type, param

    def body(self) -> dict[str, Any]:
        """SGLang's `ErrorResponse`."""
        return {
            "object": "error",
            "message": str(self),
            "type": self.type,
            "param": self.param,
            "code": self.status,
        }


@dataclass(frozen=True, slots=True)
class OpenAICall:
    """One generated choice, as the engine saw it."""

    endpoint: Literal["completions", "chat.completions"]
    prompt_ids: list[int]
    """The exact ids sent to the engine (the rendered chat template, for chat)."""
    output_ids: list[int]
    """The exact ids the engine generated (stop token included)."""
    output_logprobs: list[float]
    """Log-prob of each generated id (at the request's temperature)."""
    finish_reason: str
    """The engine's finish reason: stop, length or abort."""
    weight_version: int
    """The engine's weight version when the choice finished."""
    text: str
    """The decoded output (special tokens skipped, before tool-call parsing)."""


class BaseRequest(BaseModel):
    """Fields shared by both endpoints (unknown keys are ignored, as SGLang does)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    stream: bool = False
    echo: bool = False
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    return_token_ids: bool = False
    rid: str | None = None

    def unsupported(self) -> list[str]:
        """Keys whose values verst cannot honour."""
        bad = []
        if self.stream:
            bad.append("stream=true (use stream=false)")
        if self.echo:
            bad.append("echo=true")
        for key in ("frequency_penalty", "presence_penalty"):
            if getattr(self, key) not in (None, 0):
                bad.append(f"{key}={getattr(self, key)} (only 0)")
        if self.repetition_penalty not in (None, 1):
            bad.append(f"repetition_penalty={self.repetition_penalty} (only 1)")
        if self.min_tokens:
            bad.append(f"min_tokens={self.min_tokens} (only 0)")
        if self.logit_bias:
            bad.append("logit_bias")
        if self.best_of not in (None, 1, self.n):
            bad.append(f"best_of={self.best_of}")
        return bad


class CompletionRequest(BaseRequest):
    """`/v1/completions`."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)


class ChatRequest(BaseRequest):
    """`/v1/chat/completions`."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    return_prompt_token_ids: bool = False
    response_format: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _roles(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] has no 'role'")
            if m["role"].lower() not in CHAT_ROLES:
                raise ValueError(f"messages[{i}].role {m['role']!r} is not one of {list(CHAT_ROLES)}")
            out.append({**m, "role": m["role"].lower()})
        return out

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, t in enumerate(tools or []):
            if t.get("type", "function") != "function":
                raise ValueError(f"tools[{i}].type must be 'function', got {t.get('type')!r}")
            fn = t.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(f"tools[{i}] needs a 'function' object with a 'name' string")
        return tools

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.tool_choice not in ("auto", "none"):
            bad.append(f"tool_choice={self.tool_choice!r} (only 'auto' or 'none')")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            bad.append(f"response_format={self.response_format.get('type')!r} (only 'text')")
        return bad


def parse_request(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        parts = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()]
        raise OpenAIError("invalid request: " + "; ".join(parts)) from None
    bad = req.unsupported()
    if bad:
        raise OpenAIError(f"not supported by verst serve: {', '.join(bad)}")
    return req


def text_content(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OpenAIError(f"{where}.content: only text parts are supported, got {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise OpenAIError(f"{where}.content must be a string, a list of text parts or null")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: text content, tool-call arguments as objects."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        m["content"] = text_content(m.get("content"), f"messages[{i}]")
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for j, call in enumerate(calls):
                fn = dict(call.get("function") or {}) if isinstance(call, dict) else {}
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        raise OpenAIError(
                            f"messages[{i}].tool_calls[{j}].function.arguments must be valid JSON"
                        ) from None
                fixed.append({**call, "function": fn})
            m["tool_calls"] = fixed
        out.append(m)
    return out


def parse_tool_calls(text: str, tools: list[dict[str, Any]] | None) -> tuple[str, list[dict[str, Any]]]:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks → (text before them, calls).

    Calls whose JSON does not parse or whose name is not among `tools` are dropped (SGLang's
    behaviour); the text is then returned unchanged.
    """
    names = {(t.get("function") or {}).get("name") for t in tools or []}
    calls: list[dict[str, Any]] = []
    for block in _TOOL_CALL.findall(text):
        try:
            obj = json.loads(block)
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        if tools is not None and obj["name"] not in names:
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "index": len(calls),
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                },
            }
        )
    if not calls:
        return text, []
    return text[: text.find("<tool_call>")].strip(), calls
