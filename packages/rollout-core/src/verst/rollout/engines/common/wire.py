"""SGLang's /generate wire format: parsing requests (server side) and responses (client side).

The contract is `/work/shared/sglang-api.md` (SGLang 0.5.x native API). Parsing is strict:
wrong types and unknown `sampling_params` keys raise `InvalidRequest` (HTTP 400).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from verst.rollout.engine import EngineError, GenerateOutput, GenerateRequest, SamplingParams
from verst.rollout.engines.common.errors import InvalidRequest, new_rid
from verst.rollout.moe import RoutedExperts

# key -> (accepted types, value verst serve supports or None for any)
_SAMPLING_KEYS: dict[str, tuple[tuple[type, ...], Any]] = {
    "max_new_tokens": ((int,), None),
    "temperature": ((int, float), None),
    "top_p": ((int, float), None),
    "top_k": ((int,), None),
    "min_p": ((int, float), 0),
    "stop": ((str, list), None),
    "stop_token_ids": ((list,), None),
    "ignore_eos": ((bool,), None),
    "skip_special_tokens": ((bool,), None),
    "spaces_between_special_tokens": ((bool,), None),
    "no_stop_trim": ((bool,), None),
    "n": ((int,), None),
    "min_new_tokens": ((int,), 0),
    "frequency_penalty": ((int, float), 0),
    "presence_penalty": ((int, float), 0),
    "repetition_penalty": ((int, float), 1),
    "sampling_seed": ((int,), None),
}


@dataclass(slots=True)
class WireItem:
    """One prompt of a /generate call, parsed."""

    request: GenerateRequest
    """What goes to the engine."""
    skip_special_tokens: bool
    """Decode the returned text without special tokens (SGLang default true)."""
    no_stop_trim: bool
    """Keep a matched stop string in the text (RL clients send true)."""


class SchemaError(InvalidRequest):
    """A /generate body that breaks the request schema (wrong types, unknown `sampling_params`
    keys): SGLang 0.5.23's contract gate answers these 400 `{"error": "<text>"}`, a string."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise InvalidRequest(msg)


def _schema(cond: bool, msg: str) -> None:
    if not cond:
        raise SchemaError(msg)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_list(x: Any) -> bool:
    return isinstance(x, list) and all(_is_int(i) for i in x)


def _sampling(raw: Any) -> tuple[SamplingParams, int, bool, bool]:
    _schema(isinstance(raw, dict), f"sampling_params must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_SAMPLING_KEYS))
    _schema(not unknown, f"unknown sampling_params keys {unknown}; valid keys: {sorted(_SAMPLING_KEYS)}")
    for key, value in raw.items():
        types, supported = _SAMPLING_KEYS[key]
        if value is None and key in ("sampling_seed", "stop", "stop_token_ids"):
            continue
        ok = isinstance(value, types) and (bool in types or not isinstance(value, bool))
        _schema(ok, f"sampling_params.{key} must be {'/'.join(t.__name__ for t in types)}, got {value!r}")
        if supported is not None:
            _check(value == supported, f"sampling_params.{key}={value!r} is not supported by verst serve")
    stop = raw.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    _check(all(isinstance(s, str) and s for s in stop), "sampling_params.stop must be non-empty strings")
    stop_ids = raw.get("stop_token_ids") or []
    _schema(_int_list(stop_ids), "sampling_params.stop_token_ids must be a list of ints")
    n = raw.get("n", 1)
    _check(n >= 1, f"sampling_params.n must be >= 1, got {n}")
    params = SamplingParams(
        max_new_tokens=raw.get("max_new_tokens", 128),
        temperature=float(raw.get("temperature", 1.0)),
        top_p=float(raw.get("top_p", 1.0)),
        top_k=raw.get("top_k", -1),
        stop=stop,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=raw.get("ignore_eos", False),
        sampling_seed=raw.get("sampling_seed"),
    )
    return params, n, raw.get("skip_special_tokens", True), raw.get("no_stop_trim", False)


class RequestTooLarge(InvalidRequest):
    """One /generate call asks for more tokens than the server allows (HTTP 413)."""

    status = 413


def _check_bounds(
    prompts: list[list[int]], parsed: list[Any], max_tokens: int | None, max_sequences: int | None
) -> None:
    """Refuse (`RequestTooLarge`) a call with more sequences (prompts × n) than `max_sequences`,
    or more tokens (per sequence: its prompt plus max_new_tokens) than `max_tokens`."""
    sequences = sum(n for _, n, _, _ in parsed)
    if max_sequences is not None and sequences > max_sequences:
        raise RequestTooLarge(
            f"the request asks for {sequences} sequences (prompts × n), more than this server's "
            f"--max-request-sequences {max_sequences}; split it into smaller requests"
        )
    if max_tokens is not None:
        asked = sum(
            n * (len(p) + max(1, params.max_new_tokens))
            for p, (params, n, _, _) in zip(prompts, parsed, strict=True)
        )
        if asked > max_tokens:
            raise RequestTooLarge(
                f"the request asks for up to {asked} tokens (prompts × n × (prompt + max_new_tokens)), more "
                f"than this server's --max-request-tokens {max_tokens}; split it into smaller requests"
            )


def _prompts(body: dict[str, Any], tokenizer: Any) -> tuple[list[Any], bool]:
    """The prompts' token ids (from `input_ids`, or `text` encoded) and whether it is a batch."""
    _check(("text" in body) != ("input_ids" in body), "give exactly one of 'text' and 'input_ids'")
    if "input_ids" in body:
        ids = body["input_ids"]
        batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        _schema(
            all(_int_list(p) for p in prompts), "input_ids must be a list of ints or a list of such lists"
        )
    else:
        text = body["text"]
        batch = isinstance(text, list)
        texts = text if batch else [text]
        _schema(all(isinstance(t, str) for t in texts), "text must be a string or a list of strings")
        _check(tokenizer is not None, "this server has no tokenizer; send input_ids")
        prompts = [tokenizer.encode(t) for t in texts]
    _check(bool(prompts), "empty batch")
    return prompts, batch


def _per_prompt(body: dict[str, Any], count: int, batch: bool) -> tuple[list[Any], list[str]]:
    """Sampling params and rids, one per prompt (a single value applies to all)."""
    raw_sp = body.get("sampling_params") or {}
    sps = raw_sp if isinstance(raw_sp, list) else [raw_sp] * count
    _check(len(sps) == count, "sampling_params list must match the batch size")
    rids = body.get("rid")
    if rids is None:
        rids = [new_rid() for _ in range(count)]
    elif isinstance(rids, str):
        _check(not batch, "rid must be a list of strings for a batch")
        rids = [rids]
    _check(
        isinstance(rids, list) and len(rids) == count and all(isinstance(r, str) for r in rids),
        "rid must be a string (or a list of strings matching the batch)",
    )
    return sps, rids


def _logprob_options(body: dict[str, Any]) -> tuple[bool, bool, int, int, Any]:
    """`(return_logprob, stream, logprob_start_len, top_logprobs_num, token_ids_logprob)`, checked."""
    flags = {"return_logprob": False, "stream": False}
    for key, default in flags.items():
        flags[key] = body.get(key, default)
        _schema(isinstance(flags[key], bool), f"{key} must be a bool")
    start = body.get("logprob_start_len", -1)
    top_n = body.get("top_logprobs_num", 0)
    _schema(_is_int(start) and _is_int(top_n), "logprob_start_len and top_logprobs_num must be ints")
    _check(start in (-1, 0), f"logprob_start_len must be -1 or 0 in verst serve, got {start}")
    token_ids = body.get("token_ids_logprob")
    _schema(token_ids is None or _int_list(token_ids), "token_ids_logprob must be a list of ints")
    return flags["return_logprob"], flags["stream"], start, top_n, token_ids


def _routing_options(body: dict[str, Any], prompts: list[Any]) -> tuple[bool, int]:
    """`(return_routed_experts, routed_experts_start_len)` (SGLang's MoE routing fields), checked."""
    routed = body.get("return_routed_experts", False)
    start = body.get("routed_experts_start_len", 0)
    _schema(isinstance(routed, bool), "return_routed_experts must be a bool")
    _schema(_is_int(start) and start >= 0, "routed_experts_start_len must be an int >= 0")
    _check(all(start <= len(p) for p in prompts), "routed_experts_start_len must not exceed the input tokens")
    return routed, start


def _loras(body: dict[str, Any], count: int) -> list[Any]:
    """The LoRA adapter of each prompt (a single name or null applies to all)."""
    loras = body.get("lora_path")
    loras = loras if isinstance(loras, list) else [loras] * count
    _check(
        len(loras) == count and all(x is None or isinstance(x, str) for x in loras),
        "lora_path must be an adapter name (or a list of names / nulls matching the batch)",
    )
    return loras


def parse_generate(
    body: Any,
    tokenizer: Any,
    *,
    max_request_tokens: int | None = None,
    max_request_sequences: int | None = None,
    vision: Any = None,
) -> tuple[list[WireItem], bool, bool]:
    """A /generate body → (items, is_batch, stream).

    A call with more sequences (prompts × n) than `max_request_sequences`, or more tokens (each
    sequence's prompt plus max_new_tokens) than `max_request_tokens`, is refused
    (`RequestTooLarge`) before any request is built or queued.
    """
    _schema(isinstance(body, dict), "the request body must be a JSON object")
    prompts, batch = _prompts(body, tokenizer)
    prompts, images = _expand_images(body, prompts, batch, vision)
    sps, rids = _per_prompt(body, len(prompts), batch)
    return_logprob, stream, start, top_n, token_ids = _logprob_options(body)
    parsed = [_sampling(sp) for sp in sps]
    _check_bounds(prompts, parsed, max_request_tokens, max_request_sequences)
    loras = _loras(body, len(prompts))
    routed, routed_start = _routing_options(body, prompts)
    items: list[WireItem] = []
    for prompt, (params, n, skip, no_trim), rid, lora, imgs in zip(
        prompts, parsed, rids, loras, images, strict=True
    ):
        for j in range(n):
            req = GenerateRequest(
                images=imgs,
                input_ids=list(prompt),
                sampling=params,
                rid=rid if n == 1 else f"{rid}-{j}",
                return_logprob=return_logprob,
                top_logprobs_num=top_n,
                logprob_start_len=start,
                token_ids_logprob=token_ids,
                lora_path=lora or None,
                return_routed_experts=routed,
                routed_experts_start_len=routed_start,
            )
            items.append(WireItem(req, skip, no_trim))
    return items, batch or len(items) > 1, stream


def _expand_images(
    body: dict[str, Any], prompts: list[list[int]], batch: bool, vision: Any
) -> tuple[list[list[int]], list[tuple[Any, ...]]]:
    """sglang's `image_data` beside placeholder ids → expanded ids and recipes per prompt."""
    if body.get("image_data") in (None, []):
        return prompts, [() for _ in prompts]
    from verst.rollout.multimodal.images import ImageError
    from verst.rollout.multimodal.wire import images_of

    try:
        per_prompt = images_of(body, len(prompts), batch=batch)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    if vision is None:
        raise InvalidRequest("image_data was given to a text-only model; serve a vision-language checkpoint")
    ids_out, images_out = [], []
    for k, (prompt, raw) in enumerate(zip(prompts, per_prompt, strict=True)):
        try:
            resolved = [vision.resolve(x, what=f"image_data[{k}][{j}]") for j, x in enumerate(raw)]
            expanded = vision.expand(prompt, resolved)
        except ImageError as exc:
            raise InvalidRequest(str(exc)) from None
        ids_out.append(expanded.input_ids)
        images_out.append(tuple(expanded.images))
    return ids_out, images_out


def _pairs(rows: list[list[tuple[float, int]] | None] | None) -> list[Any] | None:
    if rows is None:
        return None
    return [None if r is None else [[lp, tid, None] for lp, tid in r] for r in rows]


def output_json(
    item: WireItem, out: GenerateOutput, tokenizer: Any, latency: float, *, final: bool = True
) -> dict[str, Any]:
    """A GenerateOutput → one SGLang /generate response object."""
    req = item.request
    text = out.text
    if tokenizer is not None and out.output_ids:
        text = tokenizer.decode(out.output_ids, skip_special_tokens=item.skip_special_tokens)
    finish: dict[str, Any] | None = None
    if final:
        if out.finish_reason == "stop":
            last = out.output_ids[-1] if out.output_ids else None
            matched: Any = next((s for s in req.sampling.stop if s in text[-(len(s) + 32) :]), last)
            if isinstance(matched, str) and not item.no_stop_trim:
                text = text[: text.rfind(matched)]
            finish = {"type": "stop", "matched": matched}
        elif out.finish_reason == "length":
            finish = {"type": "length", "length": out.completion_tokens}
        else:
            finish = {"type": "abort", "message": "aborted"}
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": finish,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": 0,
        "weight_version": str(out.weight_version),
        "e2e_latency": latency,
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tid, None] for lp, tid in zip(out.output_logprobs, out.output_ids, strict=True)
        ]
        if out.input_logprobs is not None:
            meta["input_token_logprobs"] = [
                [lp, tid, None] for lp, tid in zip(out.input_logprobs, req.input_ids, strict=True)
            ]
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = _pairs(out.output_top_logprobs)
            meta["input_top_logprobs"] = _pairs(out.input_top_logprobs)
        if req.token_ids_logprob:
            meta["output_token_ids_logprobs"] = _pairs(out.output_token_ids_logprobs)
            meta["input_token_ids_logprobs"] = _pairs(out.input_token_ids_logprobs)
    if req.return_routed_experts and out.routed_experts is not None:  # SGLang: base64 int32
        meta["routed_experts"] = out.routed_experts.to_sglang()
    return {"text": text, "output_ids": list(out.output_ids), "meta_info": meta}


def request_json(req: GenerateRequest) -> dict[str, Any]:
    """A GenerateRequest → a /generate body (what the client sends)."""
    body: dict[str, Any] = {
        "input_ids": list(req.input_ids),
        "sampling_params": req.sampling.to_sglang(),
        "return_logprob": req.return_logprob or req.logprob_start_len == 0,
        "logprob_start_len": req.logprob_start_len,
        "top_logprobs_num": req.top_logprobs_num,
    }
    if req.rid:
        body["rid"] = req.rid
    if req.token_ids_logprob:
        body["token_ids_logprob"] = list(req.token_ids_logprob)
    if req.lora_path is not None:
        body["lora_path"] = req.lora_path
    if req.return_routed_experts:
        body["return_routed_experts"] = True
        body["routed_experts_start_len"] = req.routed_experts_start_len
    if req.images:  # sglang's form: placeholders in the ids, the images beside them
        from verst.rollout.multimodal.wire import collapse_ids, image_data

        body["input_ids"] = collapse_ids(req.input_ids, req.images)
        body["image_data"] = image_data(req.images)
    return body


def _unpairs(rows: Any) -> list[Any] | None:
    if rows is None:
        return None
    return [None if r is None else [(float(e[0]), int(e[1])) for e in r] for r in rows]


def parse_output(data: Any, req: GenerateRequest) -> GenerateOutput:
    """One SGLang /generate response object → GenerateOutput (tokens and log-probs from
    `output_token_logprobs` when present, never by retokenising text)."""
    try:
        meta = data["meta_info"]
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type", "abort") if isinstance(finish, dict) else str(finish)
        if kind not in ("stop", "length", "abort"):
            kind = "abort"
        entries = meta.get("output_token_logprobs")
        if entries is not None:
            ids = [int(e[1]) for e in entries]
            lps = [float(e[0]) for e in entries]
        else:
            ids, lps = [int(i) for i in data.get("output_ids", [])], []
        inputs = meta.get("input_token_logprobs")
        version = meta.get("weight_version")
        prompt_tokens = int(meta.get("prompt_tokens", len(req.input_ids)))
        routed = meta.get("routed_experts")
        if routed is not None and req.return_routed_experts:  # [seqlen - 1 - start, layers, k]
            rows = prompt_tokens + len(ids) - 1 - req.routed_experts_start_len
            routed = RoutedExperts.from_sglang(routed, max(rows, 0))
        else:
            routed = None
        return GenerateOutput(
            output_ids=ids,
            output_logprobs=lps if req.return_logprob else [],
            finish_reason=kind,
            weight_version=int(version) if version not in (None, "", "default") else 0,
            prompt_tokens=prompt_tokens,
            text=data.get("text", ""),
            input_logprobs=None
            if inputs is None
            else [None if e[0] is None else float(e[0]) for e in inputs],
            output_top_logprobs=_unpairs(meta.get("output_top_logprobs")),
            input_top_logprobs=_unpairs(meta.get("input_top_logprobs")),
            output_token_ids_logprobs=_unpairs(meta.get("output_token_ids_logprobs")),
            input_token_ids_logprobs=_unpairs(meta.get("input_token_ids_logprobs")),
            routed_experts=routed,
        )
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise EngineError(
            f"malformed /generate response ({type(exc).__name__}: {exc}): {str(data)[:300]}"
        ) from exc


_RANK_SUFFIX = re.compile(r"@\d+$")


def worker_urls(data: Any) -> list[str] | None:
    """Worker URLs from a router's listing; dp-aware `http://h:p@rank` URLs name one server."""
    raw: list[Any] | None = None
    if isinstance(data, dict) and isinstance(data.get("urls"), list):
        raw = data["urls"]
    elif isinstance(data, dict) and isinstance(data.get("workers"), list):
        raw = [w.get("url") if isinstance(w, dict) else w for w in data["workers"]]
    elif isinstance(data, list):  # a bare list of workers
        raw = [w.get("url") if isinstance(w, dict) else w for w in data]
    if raw is None or not all(isinstance(u, str) for u in raw):
        return None
    urls: list[str] = []
    for u in raw:
        url = _RANK_SUFFIX.sub("", u.rstrip("/")).rstrip("/")
        if url not in urls:
            urls.append(url)
    return urls


def model_info_version(info: Any, url: str) -> int:
    """`weight_version` from /model_info; a fresh SGLang server's `"default"` is version 0."""
    try:
        raw = info["weight_version"]
        return 0 if raw in (None, "", "default") else int(raw)
    except (TypeError, KeyError, ValueError):
        raise EngineError(f"{url}/model_info has no integer weight_version: {str(info)[:200]}") from None
