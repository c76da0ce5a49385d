"""The OpenAI completions / chat-completions API over any `InferenceEngine` (no HTTP here).

`OpenAIFrontend` turns a request body (a JSON object) into engine requests and the engine's
outputs into the response body, with the field names a real SGLang 0.5.23 server uses:

- `/v1/completions`: `prompt` (text, ids, or a batch of either), `max_tokens` (default 16),
  `logprobs` (top-N), `return_token_ids` → each choice carries `token_ids` (generated) and
  `prompt_token_ids`.
- `/v1/chat/completions`: the chat template is applied here (`tools=` and
  `chat_template_kwargs` passed to it, `continue_final_message`), `logprobs` / `top_logprobs`,
  `return_token_ids` → `prompt_token_ids` + `response_token_ids` per choice
  (`return_prompt_token_ids` → the prompt ids alone); tool calls are parsed from the text by
  the configured parser (`hermes` / `qwen25`: `<tool_call>{json}</tool_call>`), as SGLang's
  `--tool-call-parser` does, and returned as `message.tool_calls` with finish `tool_calls`.

Unknown keys are ignored (as SGLang does; libraries send many); supported keys with values
verst cannot honour (e.g. `stream=true`, `echo=true`, penalties, `logit_bias`) are a 400 that
names the key. Errors raise `OpenAIError`, which the HTTP layer renders as SGLang's
`{"object": "error", "message", "type", "param", "code"}`.

Every generated choice is reported to `on_call` as an `OpenAICall` (prompt ids, output ids,
log-probs): the in-process client (`inprocess_openai`) records them so a trajectory is built from
the exact tokens.

The request models, `OpenAIError`, `OpenAICall` and the tool-call parser live in `openai_requests`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

from verst.rollout.engine import EngineError, GenerateOutput, GenerateRequest, SamplingParams
from verst.rollout.engines.serve.openai_requests import (
    TOOL_CALL_PARSERS,
    BaseRequest,
    ChatRequest,
    CompletionRequest,
    OpenAICall,
    OpenAIError,
    parse_request,
    parse_tool_calls,
    template_messages,
)

__all__ = [
    "TOOL_CALL_PARSERS",
    "OpenAICall",
    "OpenAIError",
    "OpenAIFrontend",
    "parse_tool_calls",
    "template_messages",
]


class OpenAIFrontend:
    """The OpenAI API's logic over one engine and its tokenizer (shared by `verst serve` and the
    in-process client, so both answer the same way)."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any = None,
        *,
        model_name: str | None = None,
        tool_call_parser: str | None = None,
        context_len: int | None = None,
        on_call: Callable[[OpenAICall], None] | None = None,
    ) -> None:
        """`tokenizer` defaults to `engine.tokenizer`; `model_name` (what /v1/models lists and
        responses echo) to the engine's model path; `tool_call_parser` None = no tool-call parsing
        (as SGLang without `--tool-call-parser`)."""
        if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {TOOL_CALL_PARSERS} or None, got {tool_call_parser!r}"
            )
        self.engine = engine
        self.tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
        self.model_name = model_name or str(getattr(engine, "model_path", None) or "verst")
        self.tool_call_parser = tool_call_parser
        self.context_len = context_len or getattr(engine, "context_len", None)
        self.on_call = on_call

    # -- endpoints -------------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        """`/v1/models`."""
        card = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "verst",
            "root": self.model_name,
        }
        if self.context_len:
            card["max_model_len"] = self.context_len
        return {"object": "list", "data": [card]}

    async def completions(self, body: Any) -> dict[str, Any]:
        """`/v1/completions` → a `text_completion` object."""
        req: CompletionRequest = parse_request(CompletionRequest, body)
        prompts = self._completion_prompts(req.prompt)
        top = req.logprobs or 0
        jobs = [(p, j) for p in prompts for j in range(req.n)]
        outs = await self._generate(req, [p for p, _ in jobs], req.max_tokens, top, "completions")
        choices = []
        for idx, ((prompt, _), out) in enumerate(zip(jobs, outs, strict=True)):
            text, matched = self._text(req, out)
            choice: dict[str, Any] = {
                "index": idx,
                "text": text,
                "logprobs": self._completion_logprobs(out) if req.logprobs is not None else None,
                "finish_reason": out.finish_reason,
                "matched_stop": matched,
            }
            if req.return_token_ids:
                choice["token_ids"] = list(out.output_ids)
                choice["prompt_token_ids"] = list(prompt)
            choices.append(choice)
        return self._envelope("text_completion", "cmpl", choices, prompts, outs, req.n)

    async def chat(self, body: Any) -> dict[str, Any]:
        """`/v1/chat/completions` → a `chat.completion` object."""
        req: ChatRequest = parse_request(ChatRequest, body)
        req, images = self._chat_images(req)
        prompt = self.render_chat(req)
        if images:  # image_url parts: expanded once, by the model's processor (docs/vlm.md)
            expanded = self.engine.vision.expand(prompt, images)
            prompt, images = expanded.input_ids, tuple(expanded.images)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.context_len - len(prompt)) if self.context_len else 256
        top = (req.top_logprobs or 0) if req.logprobs else 0
        outs = await self._generate(req, [prompt] * req.n, max_tokens, top, "chat.completions", images)
        parse_tools = self.tool_call_parser is not None and bool(req.tools) and req.tool_choice != "none"
        choices = []
        for idx, out in enumerate(outs):
            text, matched = self._text(req, out)
            calls: list[dict[str, Any]] = []
            if parse_tools:
                text, calls = parse_tool_calls(text, req.tools)
            message: dict[str, Any] = {"role": "assistant", "content": text, "reasoning_content": None}
            if calls:
                message["tool_calls"] = calls
            choice: dict[str, Any] = {
                "index": idx,
                "message": message,
                "logprobs": {"content": self._chat_logprobs(out)} if req.logprobs else None,
                "finish_reason": "tool_calls" if calls else out.finish_reason,
                "matched_stop": matched,
            }
            if req.return_token_ids or req.return_prompt_token_ids:
                choice["prompt_token_ids"] = list(prompt)
            if req.return_token_ids:
                choice["response_token_ids"] = list(out.output_ids)
            choices.append(choice)
        return self._envelope("chat.completion", "chatcmpl", choices, [prompt], outs, req.n)

    # -- pieces ----------------------------------------------------------------------------

    def _need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise OpenAIError("this server has no tokenizer: send token ids to /v1/completions", status=400)
        return self.tokenizer

    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self._need_tokenizer().encode(prompt)]
        if not prompt:
            raise OpenAIError("prompt must not be empty", param="prompt")
        if all(isinstance(p, str) for p in prompt):
            tok = self._need_tokenizer()
            return [tok.encode(p) for p in prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return [list(p) for p in prompt]

    def _chat_images(self, req: ChatRequest) -> tuple[ChatRequest, list[Any]]:
        """Messages with `image_url` parts → `<image>` placeholders in their text, and the images."""
        if not any(
            isinstance(m.get("content"), list)
            and any(isinstance(p, dict) and p.get("type") in ("image_url", "image") for p in m["content"])
            for m in req.messages
        ):
            return req, []
        if getattr(self.engine, "vision", None) is None:
            raise OpenAIError("image_url parts were given to a text-only model", param="messages")
        from verst.rollout.multimodal.images import ImageError
        from verst.rollout.multimodal.rows import message_images

        try:
            messages, images = message_images(list(req.messages), where="messages", store=None, base_dir=None)
        except ImageError as exc:
            raise OpenAIError(str(exc), param="messages") from None
        return req.model_copy(update={"messages": messages}), images

    def render_chat(self, req: ChatRequest) -> list[int]:
        """The prompt ids of a chat request: the tokenizer's chat template over the messages."""
        tok = self._need_tokenizer()
        if not getattr(tok, "chat_template", None):
            raise OpenAIError("the tokenizer has no chat template; use /v1/completions")
        kwargs = dict(req.chat_template_kwargs or {})
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        try:
            ids = tok.apply_chat_template(
                template_messages(req.messages),
                tools=tools,
                add_generation_prompt=not req.continue_final_message,
                continue_final_message=req.continue_final_message,
                tokenize=True,
                return_dict=False,
                **kwargs,
            )
        except OpenAIError:
            raise
        except Exception as exc:  # a template error is the request's fault (bad roles, ...)
            raise OpenAIError(f"cannot apply the chat template: {type(exc).__name__}: {exc}") from None
        if not ids:
            raise OpenAIError("the chat template rendered no tokens for these messages", param="messages")
        return [int(i) for i in ids]

    async def _generate(
        self,
        req: BaseRequest,
        prompts: list[list[int]],
        max_tokens: int,
        top: int,
        endpoint: Any,
        images: tuple[Any, ...] = (),
    ) -> list[GenerateOutput]:
        limit = self.context_len
        for p in prompts:
            if limit and len(p) >= limit:
                raise OpenAIError(
                    f"This model's maximum context length is {limit} tokens; the prompt has {len(p)} tokens",
                    param="messages" if endpoint == "chat.completions" else "prompt",
                )
        base = _sampling_params(req, max_tokens)
        rid = req.rid or f"oai-{uuid.uuid4().hex[:16]}"
        requests = []
        for i, p in enumerate(prompts):
            seed = None if req.seed is None else req.seed + i
            requests.append(
                GenerateRequest(
                    input_ids=list(p),
                    sampling=base.replace(sampling_seed=seed),
                    rid=f"{rid}-{i}",
                    return_logprob=True,
                    top_logprobs_num=top,
                    images=images,
                )
            )
        try:
            outs = await asyncio.gather(*(self.engine.generate(r) for r in requests))
        except ValueError as exc:  # the engine refused the request (an `InvalidRequest`, which is
            raise OpenAIError(str(exc)) from exc  # also an EngineError: e.g. an out-of-vocabulary id)
        except EngineError as exc:
            raise OpenAIError(str(exc), status=503, type="ServiceUnavailableError") from exc
        for r, out in zip(requests, outs, strict=True):
            if self.on_call is not None:
                self.on_call(
                    OpenAICall(
                        endpoint,
                        list(r.input_ids),
                        list(out.output_ids),
                        list(out.output_logprobs),
                        out.finish_reason,
                        out.weight_version,
                        self._decode(out.output_ids, True),
                    )
                )
        return list(outs)

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def _text(self, req: BaseRequest, out: GenerateOutput) -> tuple[str, Any]:
        text = (
            self._decode(out.output_ids, req.skip_special_tokens) if self.tokenizer is not None else out.text
        )
        if out.finish_reason != "stop":
            return text, None
        stops = _stops(req)
        for s in stops:
            at = text.rfind(s)
            if at != -1 and at >= len(text) - len(s) - 32:
                return (text if req.no_stop_trim else text[:at]), s
        return text, out.output_ids[-1] if out.output_ids else None

    def _token_str(self, tid: int) -> str:
        return self._decode([tid], False)

    def _completion_logprobs(self, out: GenerateOutput) -> dict[str, Any]:
        tokens = [self._token_str(t) for t in out.output_ids]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        tops = None
        if out.output_top_logprobs is not None:
            tops = [{self._token_str(tid): lp for lp, tid in row} for row in out.output_top_logprobs]
        return {
            "text_offset": offsets,
            "token_logprobs": list(out.output_logprobs),
            "tokens": tokens,
            "top_logprobs": tops or [],
        }

    def _chat_logprobs(self, out: GenerateOutput) -> list[dict[str, Any]]:
        rows = out.output_top_logprobs or [[] for _ in out.output_ids]
        content = []
        for tid, lp, row in zip(out.output_ids, out.output_logprobs, rows, strict=True):
            tok = self._token_str(tid)
            content.append(
                {
                    "token": tok,
                    "bytes": list(tok.encode()),
                    "logprob": lp,
                    "top_logprobs": [
                        {"token": (s := self._token_str(t)), "bytes": list(s.encode()), "logprob": v}
                        for v, t in row
                    ],
                }
            )
        return content

    def _envelope(
        self,
        obj: str,
        prefix: str,
        choices: list[Any],
        prompts: list[list[int]],
        outs: list[GenerateOutput],
        n: int,
    ) -> dict[str, Any]:
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(o.completion_tokens for o in outs)
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": obj,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            "metadata": {"weight_version": str(max((o.weight_version for o in outs), default=0))},
        }


def _stops(req: BaseRequest) -> tuple[str, ...]:
    """The request's stop strings (`stop` is one string or a list)."""
    return (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())


def _sampling_params(req: BaseRequest, max_tokens: int) -> SamplingParams:
    """verst's sampling settings of an OpenAI request (its defaults where a field is unset)."""
    stop = _stops(req)
    if not all(stop):
        raise OpenAIError("stop strings must not be empty", param="stop")
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k in (None, 0) else req.top_k,
        stop=stop,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
    )
