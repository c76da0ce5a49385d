"""vLLM's token-in / token-out wire (`POST /inference/v1/generate`, vllm 0.32 / 0.33).

Why this route and not `/v1/completions` with id prompts: its request takes `token_ids` (never
re-tokenised), its answer carries each output token's id next to its log-prob
(`choices[].logprobs.content[].{token_id, logprob}`) and the per-span weight versions
(`choices[].weight_versions = [{version, start, end}]`, output-token indexes), which the
completions route does not return. It needs the server flag `--enable-scale-out`
(`vllm/entrypoints/scale_out/token_in_token_out/{api_router,protocol,serving}.py`).

Request id: the server runs the request under the external id `generate-tokens-<request_id>`
(`serving.py: serve_tokens`), and `/abort_requests {"request_ids": [...]}` matches external
ids exactly (`OutputProcessor.abort_requests`); so `engine_request_id(rid)` is what an exact
abort sends. A log-prob of `-inf` arrives clamped to `-9999.0` (`_clamp_logprob`).

Routed experts (servers started with `--enable-return-routed-experts`): every choice carries
`routed_experts`, base64 of a `.npy` array `[prompt + output - 1 - start, layers, k]` (uint8 up
to 256 experts, else uint16), where `start` is the request's
`sampling_params.routed_experts_prompt_start` (`serving.py`, `numpy2base64`;
`aux_output_connector/connector.py: take_output`).

Images: collapsed ids + `content_parts`, vLLM expands them, and the answer's expanded ids are
checked against the request's (`verst.rollout.engines.vllm.images`).

Log-probs are `log_softmax(logits / T)` only when the server runs with
`--logprobs-mode processed_logprobs` (the default `raw_logprobs` ignores temperature); verst's
launcher sets it.
"""

from __future__ import annotations

from typing import Any

from verst.rollout.engine import EngineError, GenerateOutput, GenerateRequest
from verst.rollout.engines.vllm.images import check_expansion, image_fields
from verst.rollout.moe import RoutedExperts

GENERATE_PATH = "/inference/v1/generate"
"""The token-in / token-out route."""
ENGINE_ID_PREFIX = "generate-tokens-"
"""What the generate route puts before a request id to form vLLM's external request id."""


def engine_request_id(rid: str) -> str:
    """The id vLLM tracks a `/inference/v1/generate` request by (what `/abort_requests` takes)."""
    return f"{ENGINE_ID_PREFIX}{rid}"


def sampling_json(req: GenerateRequest, *, n: int = 1) -> dict[str, Any]:
    """The `sampling_params` object of one request (vLLM's `SamplingParams` field names)."""
    s = req.sampling
    out: dict[str, Any] = {
        "n": n,
        "max_tokens": max(1, s.max_new_tokens),  # vLLM needs >= 1; 0 = score only (output dropped)
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": 0 if s.top_k < 1 else s.top_k,  # vLLM: 0 disables
        "ignore_eos": s.ignore_eos,
        "include_stop_str_in_output": True,  # verst keeps a matched stop string in the text
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }
    if req.return_logprob or req.top_logprobs_num:
        out["logprobs"] = req.top_logprobs_num
    if req.logprob_start_len == 0:
        out["prompt_logprobs"] = req.top_logprobs_num
    if req.token_ids_logprob:
        out["logprob_token_ids"] = list(req.token_ids_logprob)
    out.update(s.stops_and_seed("seed"))
    if req.return_routed_experts and req.routed_experts_start_len:
        out["routed_experts_prompt_start"] = req.routed_experts_start_len
    return out


def generate_json(req: GenerateRequest, rid: str, *, n: int = 1) -> dict[str, Any]:
    """The body of `POST /inference/v1/generate` for one prompt (`n` samples of it)."""
    body: dict[str, Any] = {
        "request_id": rid,
        "token_ids": list(req.input_ids),
        "sampling_params": sampling_json(req, n=n),
    }
    if req.lora_path is not None:
        body["model"] = req.lora_path  # a loaded adapter is addressed as a model name
    if req.images:  # vLLM expands the placeholders itself (`verst.rollout.engines.vllm.images`)
        body.update(image_fields(req.input_ids, req.images))
    return body


def parse_version(raw: Any) -> int:
    """A vLLM weight-version label → verst's integer version (a fresh server's "default" is 0)."""
    if raw in (None, "", "default"):
        return 0
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise EngineError(
            f"vLLM reports weight version {raw!r}, not an integer: was the server refitted by "
            "something other than verst? (verst labels versions 0, 1, 2, ...)"
        ) from None


def token_versions(spans: Any, n_tokens: int, fallback: int) -> list[int]:
    """`weight_versions` spans (`[{version, start, end}]` over output-token indexes) → one
    version per output token; tokens no span covers get `fallback`."""
    out = [fallback] * n_tokens
    for span in spans or []:
        version = parse_version(span.get("version"))
        start, end = int(span.get("start", 0)), int(span.get("end", 0))
        for i in range(max(0, start), min(n_tokens, end)):
            out[i] = version
    return out


def _finish(raw: Any) -> str:
    return raw if raw in ("stop", "length", "abort") else "abort"


def _top(entries: Any) -> list[tuple[float, int]]:
    return [(float(e["logprob"]), int(e["token_id"])) for e in entries or []]


def _prompt_logprobs(
    rows: Any, prompt: list[int], top: int
) -> tuple[list[float | None], list[list[tuple[float, int]] | None] | None]:
    """`prompt_logprobs` (per position `{token_id: {logprob, rank, ...}}`, first None) → the
    prompt tokens' own log-probs and, with `top`, the top-k per position."""
    lps: list[float | None] = []
    tops: list[list[tuple[float, int]] | None] = []
    for pos, row in enumerate(rows or []):
        if row is None:
            lps.append(None)
            tops.append(None)
            continue
        table = {int(k): float(v["logprob"]) for k, v in row.items()}
        lps.append(table.get(prompt[pos]))
        ranked = sorted(row.items(), key=lambda kv: kv[1].get("rank") or 0)
        tops.append([(float(v["logprob"]), int(k)) for k, v in ranked if (v.get("rank") or 0) >= 1][:top])
    return lps, (tops if top else None)


def _routed_experts(b64: Any, req: GenerateRequest, prompt: int, output: int) -> RoutedExperts | None:
    """`choices[i].routed_experts` (servers with `--enable-return-routed-experts`): rows for
    positions `[routed_experts_prompt_start, prompt + output - 1)`; None when the server sent
    none (flag off, or aborted before any forward)."""
    if not b64:
        return None
    rows = RoutedExperts.from_npy(b64)
    want = prompt + output - 1 - req.routed_experts_start_len
    if rows.tokens != want:
        raise EngineError(
            f"vLLM returned routed experts for {rows.tokens} positions, expected {want} "
            f"(prompt {prompt} + output {output} - 1 - start {req.routed_experts_start_len})"
        )
    return rows


def parse_choice(
    data: dict[str, Any], choice: dict[str, Any], req: GenerateRequest, fallback_version: int
) -> GenerateOutput:
    """One choice of a generate answer → `GenerateOutput` (ids and log-probs from the answer's
    `token_ids` / `logprobs.content`, never from text)."""
    ids = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    if content and [int(c["token_id"]) for c in content] != ids:
        raise EngineError("vLLM's logprobs.content token ids differ from the choice's token_ids")
    if req.sampling.max_new_tokens == 0:
        ids, content = [], []
    versions = token_versions(choice.get("weight_versions"), len(ids), fallback_version)
    out = GenerateOutput(
        output_ids=ids,
        output_logprobs=[float(c["logprob"]) for c in content] if req.return_logprob else [],
        finish_reason=_finish(choice.get("finish_reason")),  # type: ignore[arg-type]
        weight_version=versions[-1] if versions else fallback_version,
        prompt_tokens=len(data.get("prompt_token_ids") or req.input_ids),
        output_token_versions=versions,
    )
    if req.top_logprobs_num:
        out.output_top_logprobs = [_top(c.get("top_logprobs")) for c in content]
    if req.return_routed_experts:
        out.routed_experts = _routed_experts(choice.get("routed_experts"), req, out.prompt_tokens, len(ids))
    if req.logprob_start_len == 0:
        lps, tops = _prompt_logprobs(data.get("prompt_logprobs"), list(req.input_ids), req.top_logprobs_num)
        out.input_logprobs, out.input_top_logprobs = lps, tops
    return out


def parse_generate(data: Any, req: GenerateRequest, fallback_version: int) -> list[GenerateOutput]:
    """A whole generate answer → one output per choice (in `index` order)."""
    try:
        if req.images:
            check_expansion(data, req.input_ids, req.images)
        choices = sorted(data["choices"], key=lambda c: int(c.get("index", 0)))
        return [parse_choice(data, c, req, fallback_version) for c in choices]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EngineError(
            f"malformed {GENERATE_PATH} answer ({type(exc).__name__}: {exc}): {str(data)[:300]}"
        ) from exc
