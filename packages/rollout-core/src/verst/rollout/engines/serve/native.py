"""`verst serve`: generation (single, batch, SSE stream), abort, health, model/server info, cache
flush, pause/continue, loads — SGLang's native API minus weights and memory (`weights`)."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from aiohttp import web

from verst.rollout.engine import EngineError, GenerateOutput
from verst.rollout.engines.common.errors import InvalidRequest
from verst.rollout.engines.common.wire import SchemaError, WireItem, output_json, parse_generate
from verst.rollout.engines.serve.state import (
    MAX_REQUEST_SEQUENCES,
    MAX_REQUEST_TOKENS,
    STATE,
    VERSION,
    ServerState,
    error_response,
    generate_error,
    read_body,
)

log = logging.getLogger("verst.serve")


def _aborted(state: ServerState, item: WireItem) -> GenerateOutput:
    return GenerateOutput([], [], "abort", state.engine.weight_version, len(item.request.input_ids))


async def _run_one(state: ServerState, item: WireItem) -> GenerateOutput:
    if state.stopping:
        return _aborted(state, item)
    delay = state.latency.draw()
    if delay > 0:
        event = asyncio.Event()
        state.delayed[item.request.rid] = event
        try:
            await asyncio.wait_for(event.wait(), delay)
            return _aborted(state, item)
        except TimeoutError:
            pass
        finally:
            state.delayed.pop(item.request.rid, None)
        if state.stopping:
            return _aborted(state, item)
    return await state.engine.generate(item.request)


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_body(request)
    try:
        items, batch, stream = parse_generate(
            body,
            state.engine.tokenizer,
            max_request_tokens=request.app[MAX_REQUEST_TOKENS],
            max_request_sequences=request.app[MAX_REQUEST_SEQUENCES],
            vision=getattr(state.engine, "vision", None),
        )
        state.refuse_if_released("generate")
    except InvalidRequest as exc:
        return generate_error(str(exc), getattr(exc, "status", 400), schema=isinstance(exc, SchemaError))
    tok = state.engine.tokenizer
    start = time.perf_counter()
    if stream:
        if len(items) != 1:
            raise InvalidRequest("stream=true supports a single prompt (n=1) in verst serve")
        return await _stream(request, state, items[0], start)
    outs = await asyncio.gather(*(_run_one(state, it) for it in items))
    latency = time.perf_counter() - start
    payload = [output_json(it, out, tok, latency) for it, out in zip(items, outs, strict=True)]
    for p in payload:
        p["meta_info"]["weight_version"] = state.version_label(int(p["meta_info"]["weight_version"]))
    return web.json_response(payload if batch else payload[0])


async def _stream(
    request: web.Request, state: ServerState, item: WireItem, start: float
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    tok = state.engine.tokenizer
    async for out, final in state.engine.generate_stream(item.request):
        chunk = output_json(item, out, tok, time.perf_counter() - start, final=final)
        chunk["meta_info"]["weight_version"] = state.version_label(out.weight_version)
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def abort_request(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request)
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
    if not isinstance(rid, str) or not isinstance(abort_all, bool):
        raise InvalidRequest("abort_request takes {'rid': str, 'abort_all': bool}")
    if not abort_all and not rid:  # SGLang: an empty rid would match everything; ignored
        return web.Response(status=200)
    for key, event in list(state.delayed.items()):
        if abort_all or key == rid:
            event.set()
    if abort_all:
        await state.engine.abort(None)
    else:
        await state.engine.abort_rids([rid])  # exact, like SGLang's tokenizer manager
    return web.Response(status=200)


async def health(request: web.Request) -> web.Response:
    ok = await request.app[STATE].engine.health()
    return web.Response(status=200 if ok else 503)


async def health_generate(request: web.Request) -> web.Response:
    from verst.rollout.engine import GenerateRequest, SamplingParams

    engine = request.app[STATE].engine
    if not await engine.health():
        return web.Response(status=503)
    if engine.paused:
        return web.Response(status=200)
    probe = GenerateRequest([0], SamplingParams(max_new_tokens=1, temperature=0), rid="health-probe-")
    try:
        await asyncio.wait_for(engine.generate(probe), 20)
    except (TimeoutError, EngineError):
        return web.Response(status=503)
    return web.Response(status=200)


async def model_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    e = state.engine
    return web.json_response(
        {
            "model_path": e.model_path,
            "tokenizer_path": state.info.get("tokenizer_path") or e.model_path,
            "is_generation": True,
            "weight_version": state.version_label(),
            "context_length": e.context_len,
            "preferred_sampling_params": None,
        }
    )


async def server_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    info = {**state.info, "version": VERSION, "weight_version": state.version_label(), "tp_size": 1}
    info["context_length"] = state.engine.context_len
    info["max_batch_size"] = state.engine.max_batch_size
    info["dtype"] = state.engine.weight_dtype  # resolved ('auto' becomes the model's)
    info["startup_time"] = state.startup_time
    spec = getattr(state.engine, "speculative_stats", None)
    if spec is not None:
        info["speculative"] = spec  # counters since start (`speculative.step.SpeculativeStats`)
    return web.json_response(info)


async def flush_cache(request: web.Request) -> web.Response:
    if request.app[STATE].engine.flush_cache():
        return web.Response(text="Cache flushed.")
    return error_response(400, "cannot flush the cache while requests are running; pause generation first")


async def pause_generation(request: web.Request) -> web.Response:
    engine = request.app[STATE].engine
    body = await read_body(request)
    mode = body.get("mode", "abort") if isinstance(body, dict) else None
    if mode not in ("abort", "retract", "in_place"):
        raise InvalidRequest(f"mode must be one of abort, retract, in_place; got {mode!r}")
    engine.pause()
    if mode == "abort":
        await engine.abort(None)
    return web.json_response({"status": "ok", "message": f"generation paused ({mode})"})


async def continue_generation(request: web.Request) -> web.Response:
    request.app[STATE].engine.resume()
    return web.json_response({"status": "ok", "message": "generation continued"})


async def loads(request: web.Request) -> web.Response:
    load = request.app[STATE].engine.load()
    return web.json_response({"loads": [{**load, "dp_rank": 0}]})


def add_native_routes(app: web.Application) -> None:
    """Generation, abort, health, info, cache and pause routes of SGLang's native API."""
    r = app.router
    r.add_post("/generate", generate)
    r.add_post("/abort_request", abort_request)
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
    for name, handler in (("model_info", model_info), ("server_info", server_info)):
        r.add_get(f"/{name}", handler)
        r.add_get(f"/get_{name}", handler)
    r.add_route("*", "/flush_cache", flush_cache)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_get("/v1/loads", loads)
