"""The built-in tool environment: tools are plain Python callables (sync or async).

    def multiply(a: int, b: int) -> int:
        '''Multiply two integers.

        Args:
            a: the first factor.
            b: the second factor.
        '''
        return a * b

Each tool's JSON schema comes from its signature and docstring (`tool_schema`). The model
calls tools in the common format

    <tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>

and every call's result comes back in one observation, `<tool_response>408</tool_response>`
per call (or as `tool` chat messages when the episode runs on the chat template). A turn
without a tool call ends the episode (termination `stop`). A malformed call, an unknown tool,
a tool that raises or exceeds `tool_timeout_s` gives the model an error response and is
counted (`tool_errors`, `malformed_calls`, `unknown_tools`, `tool_timeouts`) — never a crash
or a hang; `max_tool_errors` consecutive failed turns end the episode (`tool_error`).

A sync tool runs, by default, in a child process forked for the call, which is killed when the
call times out, so a timed-out tool really stops (`sync_tool_runner = "process"`; see
`verst.rollout.agentic.tool_runner` for what that implies). `sync_tool_runner = "thread"` runs
it in a worker thread instead, sharing this process's memory; a timed-out thread cannot be
stopped and runs to completion in the background. An async tool is cancelled at its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from verst.rollout.agentic.environment import EnvironmentFactory, EnvSetup, ModelTurn, Observation, StepResult
from verst.rollout.agentic.python_tool import PythonTool, PythonToolConfig
from verst.rollout.agentic.tool_runner import SyncToolRunner, run_sync_tool
from verst.rollout.agentic.tracing import tool_span
from verst.rollout.importing import import_object
from verst.rollout.logging_utils import sample_text_preview
from verst.rollout.sample import Sample

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
"""One tool call in the model's text."""

_JSON_TYPES: dict[Any, str] = {
    int: "integer",
    float: "number",
    str: "string",
    bool: "boolean",
    list: "array",
    tuple: "array",
    dict: "object",
}


# --------------------------------------------------------------------------- schemas


def _json_type(annotation: Any) -> dict[str, Any]:
    if annotation is inspect.Parameter.empty or annotation is Any:
        return {}
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(annotation))}
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _json_type(args[0]) if len(args) == 1 else {"anyOf": [_json_type(a) for a in args]}
    if origin in (list, tuple, Sequence):
        args = typing.get_args(annotation)
        out: dict[str, Any] = {"type": "array"}
        if args and args[0] is not Ellipsis:
            out["items"] = _json_type(args[0])
        return out
    if origin is dict:
        return {"type": "object"}
    json_type = _JSON_TYPES.get(annotation)
    return {"type": json_type} if json_type else {}


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a Google-style (`Args:`) or Sphinx-style
    (`:param x:`) docstring. The description is the first paragraph."""
    lines = inspect.cleandoc(doc or "").splitlines()
    description: list[str] = []
    for line in lines:
        if not line.strip():
            break
        description.append(line.strip())
    params: dict[str, str] = {}
    in_args, indent, last = False, None, None
    for line in lines:
        stripped = line.strip()
        sphinx = re.match(r":param\s+(?:\w+\s+)?(\w+):\s*(.*)", stripped)
        if sphinx:
            params[sphinx.group(1)] = sphinx.group(2)
            continue
        if re.fullmatch(r"(Args|Arguments|Parameters|Returns|Raises|Yields|Examples?):", stripped):
            in_args, indent, last = stripped[:-1] in ("Args", "Arguments", "Parameters"), None, None
            continue
        if not in_args or not stripped:
            continue
        depth = len(line) - len(line.lstrip())
        m = re.match(r"(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)", stripped)
        if m and (indent is None or depth == indent):
            indent, last = depth, m.group(1)
            params[last] = m.group(2)
        elif last is not None and indent is not None and depth > indent:
            params[last] = f"{params[last]} {stripped}".strip()
    return " ".join(description), params


def tool_schema(fn: Callable[..., Any], name: str | None = None) -> dict[str, Any]:
    """The OpenAI-style function schema of `fn`, from its signature and docstring."""
    description, param_docs = _docstring_parts(fn.__doc__ or "")
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    properties: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        prop = _json_type(hints.get(pname, param.annotation))
        if pname in param_docs:
            prop["description"] = param_docs[pname]
        if param.default is inspect.Parameter.empty:
            required.append(pname)
        else:
            if isinstance(param.default, int | float | str | bool | type(None)):
                prop["default"] = param.default
        properties[pname] = prop
    return {
        "type": "function",
        "function": {
            "name": name or fn.__name__,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


@dataclass(frozen=True)
class Tool:
    """A callable exposed to the model, with its schema."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]

    @classmethod
    def of(cls, fn: Callable[..., Any] | Tool, name: str | None = None) -> Tool:
        if isinstance(fn, Tool):
            return fn
        name = name or getattr(fn, "__name__", None)
        if not name:
            raise ValueError(f"tool {fn!r} has no __name__; pass a name")
        return cls(name, fn, tool_schema(fn, name))

    @property
    def is_async(self) -> bool:
        fn = self.fn.func if isinstance(self.fn, functools.partial) else self.fn
        return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


# --------------------------------------------------------------------------- parsing


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call, or the reason it could not be parsed (`error`)."""

    name: str = ""
    arguments: dict[str, Any] | None = None
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>{...}</tool_call>` in `text`, in order (malformed ones carry `error`).

    An opening `<tool_call>` that is never closed is one malformed call.
    """
    calls: list[ToolCall] = []
    end = 0
    for match in TOOL_CALL_RE.finditer(text):
        end = match.end()
        body = match.group(1).strip()
        try:
            data = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall(error=f"malformed tool call (invalid JSON: {exc.msg} at char {exc.pos})"))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            calls.append(ToolCall(error='malformed tool call: expected {"name": ..., "arguments": {...}}'))
            continue
        args = data.get("arguments", {})
        if isinstance(args, str):  # some chat formats send arguments as a JSON string
            with contextlib.suppress(json.JSONDecodeError):
                args = json.loads(args)
        if not isinstance(args, dict):
            calls.append(
                ToolCall(name=data["name"], error="malformed tool call: arguments must be an object")
            )
            continue
        calls.append(ToolCall(name=data["name"], arguments=args))
    if "<tool_call>" in text[end:]:
        calls.append(ToolCall(error="malformed tool call: <tool_call> without </tool_call>"))
    return calls


# --------------------------------------------------------------------------- the environment


class ToolEnvironmentConfig(BaseModel):
    """Options of the built-in tool environment (`[rollout.env.options]` with `type = "tools"`)."""

    model_config = ConfigDict(extra="forbid")

    tools: list[str] = Field(
        default_factory=list,
        description="Import paths 'pkg.module:function' of the tools (sync or async callables), or "
        "built-in names: 'python' (code run in the sandbox, `python` below).",
    )
    python: PythonToolConfig = Field(
        default_factory=PythonToolConfig, description="Options of the built-in 'python' tool."
    )
    tool_timeout_s: float = Field(
        10.0, gt=0, description="Timeout of one tool call (then an error response)."
    )
    sync_tool_runner: SyncToolRunner = Field(
        "process",
        description="Where a sync tool runs: 'process' (a forked child, killed at the timeout, so a timed-out "
        "tool really stops; its changes to its own memory stay in the child) or 'thread' (a worker thread in "
        "this process, which a timeout cannot stop).",
    )
    max_tool_errors: int | None = Field(
        None,
        ge=1,
        description="End the episode (termination tool_error) after this many failed turns in a row.",
    )
    max_calls_per_turn: int = Field(8, ge=1, description="Tool calls executed per model turn at most.")
    response_prefix: str = Field(
        "", description="Text before the tool responses of a turn (e.g. a role marker)."
    )
    response_suffix: str = Field("", description="Text after the tool responses of a turn.")
    chat_template: bool | None = Field(
        None,
        description="Render the prompt (with tools=) and tool responses with the tokenizer's chat template "
        "instead of plain text (None = when the prompt is chat messages).",
    )
    max_response_chars: int = Field(2000, ge=1, description="Tool results are cut to this many characters.")


BUILTIN_TOOLS: dict[str, Callable[[ToolEnvironmentConfig], Callable[..., Any]]] = {
    "python": lambda config: PythonTool(config.python),
}
"""Built-in tools by name (built once per environment factory from the options)."""


def _load_tool(path: str, config: ToolEnvironmentConfig) -> Tool:
    if path in BUILTIN_TOOLS:
        return Tool.of(BUILTIN_TOOLS[path](config), path)
    return Tool.of(import_object(path, what="tool"))


class ToolEnvironment:
    """One episode with tools (see the module docstring)."""

    Config = ToolEnvironmentConfig

    def __init__(
        self, tools: Sequence[Callable[..., Any] | Tool], config: ToolEnvironmentConfig | None = None
    ) -> None:
        self.config = config or ToolEnvironmentConfig()
        self.tools: dict[str, Tool] = {}
        """Tools by name."""
        for fn in tools:
            tool = Tool.of(fn)
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool
        self._failed_turns = 0
        self._chat = False

    @classmethod
    def factory(cls, config: ToolEnvironmentConfig, setup: EnvSetup) -> EnvironmentFactory:
        """Load the tools once; every episode gets its own environment over them."""
        tools = [_load_tool(path, config) for path in config.tools]
        return lambda: cls(tools, config)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    async def reset(self, sample: Sample) -> Observation | None:
        self._failed_turns = 0
        chat = self.config.chat_template
        self._chat = isinstance(sample.prompt, list) if chat is None else chat
        if not self._chat:
            return None  # the sample's prompt, as the data source gave it
        messages = (
            sample.prompt if isinstance(sample.prompt, list) else [{"role": "user", "content": sample.prompt}]
        )
        return Observation(messages=tuple(messages), tools=tuple(self.schemas))

    async def step(self, turn: ModelTurn) -> StepResult:
        calls = parse_tool_calls(turn.text)
        if not calls:
            return StepResult(done=True, termination="stop")
        metrics = {
            "tool_calls": 0.0,
            "tool_errors": 0.0,
            "tool_timeouts": 0.0,
            "malformed_calls": 0.0,
            "unknown_tools": 0.0,
        }
        extra = calls[self.config.max_calls_per_turn :]
        calls = calls[: self.config.max_calls_per_turn]
        results = await asyncio.gather(*(self._run(call, metrics) for call in calls))
        if extra:
            results.append(
                f"error: only {self.config.max_calls_per_turn} tool calls per turn; {len(extra)} ignored"
            )
            metrics["tool_errors"] += 1
        failed = any(r.startswith("error:") for r in results)
        self._failed_turns = self._failed_turns + 1 if failed else 0
        limit = self.config.max_tool_errors
        if limit is not None and self._failed_turns >= limit:
            return StepResult(done=True, termination="tool_error", metrics=metrics)
        return StepResult(observation=self._observation(results), metrics=metrics)

    async def close(self) -> None:
        pass

    def _observation(self, results: list[str]) -> Observation:
        if self._chat:
            return Observation(messages=tuple({"role": "tool", "content": r} for r in results))
        body = "".join(f"<tool_response>{r}</tool_response>" for r in results)
        return Observation(text=f"{self.config.response_prefix}{body}{self.config.response_suffix}")

    async def _run(self, call: ToolCall, metrics: dict[str, float]) -> str:
        metrics["tool_calls"] += 1
        if call.error is not None:
            metrics["malformed_calls"] += 1
            metrics["tool_errors"] += 1
            return f"error: {call.error}"
        tool = self.tools.get(call.name)
        if tool is None:
            metrics["unknown_tools"] += 1
            metrics["tool_errors"] += 1
            return f"error: unknown tool {call.name!r}; available tools: {', '.join(sorted(self.tools)) or 'none'}"
        with tool_span(tool.name) as span:
            try:
                result = await asyncio.wait_for(
                    self._invoke(tool, call.arguments or {}), self.config.tool_timeout_s
                )
            except TimeoutError:
                span.status = "timeout"
                metrics["tool_timeouts"] += 1
                metrics["tool_errors"] += 1
                return f"error: tool {tool.name!r} timed out after {self.config.tool_timeout_s:g}s"
            except Exception as exc:
                span.status = "error"
                span.detail["error"] = type(exc).__name__
                metrics["tool_errors"] += 1
                return f"error: {type(exc).__name__}: {sample_text_preview(str(exc), 300)}"
        return self._format(result)

    async def _invoke(self, tool: Tool, arguments: dict[str, Any]) -> Any:
        try:
            inspect.signature(tool.fn).bind(**arguments)
        except TypeError as exc:
            raise TypeError(f"bad arguments for {tool.name}: {exc}") from None
        if tool.is_async:
            return await tool.fn(**arguments)
        return await run_sync_tool(tool.fn, arguments, self.config.sync_tool_runner)

    def _format(self, result: Any) -> str:
        text = result if isinstance(result, str) else json.dumps(result, default=str)
        limit = self.config.max_response_chars
        return text if len(text) <= limit else text[:limit] + "…"
