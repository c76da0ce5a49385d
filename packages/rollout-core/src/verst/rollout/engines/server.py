"""`verst serve`: the embedded engine behind SGLang's native HTTP API (the subset RL uses).

    verst serve --model PATH --host 127.0.0.1 --port 30000
    python -m verst.rollout.engines.server --model PATH --port 30000

Endpoints: /generate (single, batch, SSE stream), /abort_request, /health, /health_generate,
/model_info, /server_info (+ get_ aliases), /flush_cache, /pause_generation,
/continue_generation, /update_weights_from_disk, /update_weights_from_tensor, /v1/loads,
/release_memory_occupation, /resume_memory_occupation, /init_weights_update_group,
/update_weights_from_distributed (gloo on CPU, NCCL on CUDA; the group SGLang builds, see
`weight_group`), /destroy_weights_update_group, /begin_weight_update, /end_weight_update, and the
OpenAI API (`openai_api`: /v1/models, /v1/completions, /v1/chat/completions;
`--served-model-name`, `--tool-call-parser`).
Bad requests get a 4xx in SGLang's shapes (`{"error": {"message"}}` from /generate, an
`ErrorResponse` `{"object": "error", "message", "type", "code"}` elsewhere); the server never
dies on one.

It enforces SGLang 0.5.23's protocol so the client's tests catch a regression: tensor and
distributed updates outside a `/begin_weight_update` … `/end_weight_update` session fail
(`success: false`); `/abort_request` matches a rid exactly (an empty rid without `abort_all` is
ignored); `weight_version` is a string, `"default"` until set (unless `--weight-version`), and
an update without one keeps it; `/release_memory_occupation` needs an idle or paused server,
`tags: null` releases weights too, released weights come back on resume only with
`--enable-weights-cpu-backup` (else a refit must load them), and generating or refitting into
released memory is refused instead of computing on freed buffers.

`--inject-latency-ms MEAN --inject-latency-fraction F` delays a seeded random fraction F of
/generate requests by a uniform 0.5–1.5 × MEAN ms before they reach the engine (an aborted
delayed request returns at once with finish `abort`), to simulate long-tailed generation.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import pickle
import random
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

from aiohttp import web

from verst.rollout.engine import EngineError, GenerateOutput
from verst.rollout.engines._common import InvalidRequest
from verst.rollout.engines._wire import WireItem, output_json, parse_generate
from verst.rollout.engines.lora_http import add_lora_args, add_lora_routes
from verst.rollout.engines.openai_api import register_openai_routes
from verst.rollout.engines.weight_group import DistributedRefit

log = logging.getLogger("verst.serve")
VERSION = "verst-serve 0.1 (SGLang native API subset)"


@dataclass(slots=True)
class LatencyInjection:
    """Simulated long-tailed generation: delay a random fraction of requests."""

    mean_ms: float = 0.0
    """Mean delay of a delayed request (uniform in 0.5–1.5 × mean)."""
    fraction: float = 0.0
    """Fraction of /generate requests that are delayed."""
    seed: int = 0
    """Seed of the draw (which requests, how long)."""
    rng: random.Random = field(default_factory=random.Random)
    """The seeded generator (set up by `build_app`)."""

    def draw(self) -> float:
        """Seconds to delay the next request (0 for most)."""
        if self.mean_ms <= 0 or self.fraction <= 0 or self.rng.random() >= self.fraction:
            return 0.0
        return self.mean_ms * self.rng.uniform(0.5, 1.5) / 1000.0


MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
"""SGLang's memory-occupation tags (`GPU_MEMORY_ALL_TYPES`)."""


class _State:
    """Per-app state: the engine, server args, delayed requests waiting to be aborted, and the
    protocol state SGLang keeps (version label, weight-update session, released memory)."""

    def __init__(self, engine: Any, info: dict[str, Any], latency: LatencyInjection) -> None:
        self.engine = engine
        self.info = info
        self.latency = latency
        self.delayed: dict[str, asyncio.Event] = {}
        self.version_set = info.get("weight_version") is not None or engine.weight_version != 0
        """False until a version is given (SGLang then reports "default")."""
        self.session_open = False
        """A /begin_weight_update session is open."""
        self.cpu_backup = bool(info.get("enable_weights_cpu_backup", False))
        """Released weights come back on resume (SGLang's --enable-weights-cpu-backup)."""
        self.released: set[str] = set()
        """Memory tags released and not yet resumed."""
        self.weights_lost = False
        """Weights were released without a CPU backup and no refit has loaded new ones."""

    def version_label(self, version: int | None = None) -> str:
        """The version as SGLang reports it: a string, "default" until one was set."""
        if not self.version_set:
            return "default"
        return str(self.engine.weight_version if version is None else version)

    def refuse_if_released(self, what: str) -> None:
        """Refuse to compute on released memory (SGLang would read freed buffers)."""
        if self.released:
            raise InvalidRequest(
                f"{what}: memory {sorted(self.released)} is released (/release_memory_occupation); "
                "call /resume_memory_occupation first"
            )
        if self.weights_lost:
            raise InvalidRequest(
                f"{what}: the weights were released without --enable-weights-cpu-backup and no "
                "refit has loaded new ones since /resume_memory_occupation"
            )


STATE = web.AppKey("verst_state", _State)
OPENAI_ARGS = ("model_name", "tool_call_parser")
REFIT = web.AppKey("verst_distributed_refit", DistributedRefit)
MAX_REQUEST_TOKENS = web.AppKey("verst_max_request_tokens", object)
DEFAULT_MAX_REQUEST_TOKENS = 1 << 20
"""Default bound of one /generate call: prompts × n × max_new_tokens (`--max-request-tokens`)."""
SHUTDOWN_TIMEOUT_S = 3.0
"""Seconds SIGTERM/SIGINT wait for handlers after aborting every request, before exiting."""


def _error(status: int, message: str) -> web.Response:
    """SGLang's `ErrorResponse` body (what FastAPI validation and HTTP errors return)."""
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else str(status)
    body = {"object": "error", "message": message, "type": phrase, "param": None, "code": status}
    return web.json_response(body, status=status)


def _generate_error(message: str, status: int = 400) -> web.Response:
    """SGLang's /generate error body for a rejected request (`_create_error_response`)."""
    return web.json_response({"error": {"message": message}}, status=status)


def _failure(message: str, status: int = 400) -> web.Response:
    """SGLang's control-endpoint failure: `{"success": false, "message"}` with HTTP 400."""
    return web.json_response({"success": False, "message": message}, status=status)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every failure becomes a JSON error; nothing escapes to kill the server."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, exc.reason or str(exc))
    except InvalidRequest as exc:
        return _error(getattr(exc, "status", 400), str(exc))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return _error(400, f"malformed JSON body: {exc}")
    except EngineError as exc:
        return _error(503, str(exc))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a bug: report it as JSON, keep serving
        log.exception("unhandled error in %s", request.path)
        return _error(500, f"{type(exc).__name__}: {exc}")


async def _body(request: web.Request) -> Any:
    raw = await request.read()
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except RecursionError:
        raise InvalidRequest("malformed JSON body: nested too deeply") from None


async def _run_one(state: _State, item: WireItem) -> GenerateOutput:
    delay = state.latency.draw()
    if delay > 0:
        event = asyncio.Event()
        state.delayed[item.request.rid] = event
        try:
            await asyncio.wait_for(event.wait(), delay)
            return GenerateOutput([], [], "abort", state.engine.weight_version, len(item.request.input_ids))
        except TimeoutError:
            pass
        finally:
            state.delayed.pop(item.request.rid, None)
    return await state.engine.generate(item.request)


async def generate(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await _body(request)
    try:
        items, batch, stream = parse_generate(
            body,
            state.engine.tokenizer,
            max_request_tokens=request.app[MAX_REQUEST_TOKENS],
            vision=getattr(state.engine, "vision", None),
        )
        state.refuse_if_released("generate")
    except InvalidRequest as exc:
        return _generate_error(str(exc), getattr(exc, "status", 400))
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


async def _stream(request: web.Request, state: _State, item: WireItem, start: float) -> web.StreamResponse:
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
    body = await _body(request)
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
    return web.json_response(info)


async def flush_cache(request: web.Request) -> web.Response:
    if request.app[STATE].engine.flush_cache():
        return web.Response(text="Cache flushed.")
    return _error(400, "cannot flush the cache while requests are running; pause generation first")


async def pause_generation(request: web.Request) -> web.Response:
    engine = request.app[STATE].engine
    body = await _body(request)
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


def _memory_tags(body: Any) -> set[str]:
    tags = body.get("tags") if isinstance(body, dict) else None
    if tags is None or tags == []:
        return set(MEMORY_TAGS)  # SGLang: no tags = everything, the weights included
    if not isinstance(tags, list) or not all(t in MEMORY_TAGS for t in tags):
        raise InvalidRequest(f"tags must be null or a list of {list(MEMORY_TAGS)}, got {tags!r}")
    return set(tags)


async def release_memory_occupation(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tags = _memory_tags(await _body(request))
    load = state.engine.load()
    if not state.engine.paused and (load["num_running_reqs"] or load["num_waiting_reqs"]):
        raise InvalidRequest(
            "release_memory_occupation should be called only when server is idle (pause_generation first)"
        )
    await state.engine.release_memory()
    state.released |= tags
    return web.json_response({})


async def resume_memory_occupation(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tags = _memory_tags(await _body(request))
    if "weights" in tags and "weights" in state.released and not state.cpu_backup:
        state.weights_lost = True  # the memory comes back, its contents do not
    state.released -= tags
    await state.engine.resume_memory()
    return web.json_response({})


async def begin_weight_update(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await _body(request)
    selector = body.get("selector", "all") if isinstance(body, dict) else None
    if selector not in ("target", "draft", "all"):
        raise InvalidRequest(f"selector must be 'target', 'draft' or 'all', got {selector!r}")
    if state.session_open:
        return _failure("a weight-update session is already open; call end_weight_update() first")
    state.session_open = True
    return web.json_response({"success": True, "message": "Success"})


async def end_weight_update(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.session_open:
        return _failure("no weight-update session is open; call begin_weight_update() first")
    state.session_open = False
    return web.json_response({"success": True, "message": "Success"})


def _outside_session(state: _State, what: str) -> web.Response | None:
    if state.session_open:
        return None
    return _failure(f"{what} must run between begin_weight_update() and end_weight_update()")


async def _apply(state: _State, body: dict[str, Any], update: Any) -> web.Response:
    """Run one refit call: refuse released weights, keep the version unless one is given."""
    engine = state.engine
    if "weights" in state.released:
        return _failure("the weights are released (/release_memory_occupation); resume 'weights' first")
    requested = _version_arg(body)
    try:
        version = await update(engine.weight_version if requested is None else requested)
    except InvalidRequest as exc:
        return _failure(str(exc))
    state.weights_lost = False
    if requested is not None:
        state.version_set = True
    if body.get("flush_cache", True) and not engine.flush_cache():
        return _failure(
            "Weights were updated, but the cache was not flushed because requests are still "
            "running or queued. Retract or finish them, then call /flush_cache."
        )
    return web.json_response(
        {"success": True, "message": "weights updated", "weight_version": state.version_label(version)}
    )


def _version_arg(body: dict[str, Any]) -> int | None:
    version = body.get("weight_version")
    if version is None:
        return None
    try:
        return int(version)
    except (TypeError, ValueError):
        raise InvalidRequest(f"weight_version must be an integer (or its string), got {version!r}") from None


async def update_weights_from_disk(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.engine
    body = await _body(request)
    if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
        raise InvalidRequest("update_weights_from_disk takes {'model_path': str, 'weight_version'?: str}")
    if body.get("abort_all_requests"):
        await engine.abort(None)
    resp = await _apply(state, body, lambda v: engine.update_weights_from_disk(body["model_path"], v))
    if resp.status == 200:
        resp = web.json_response({**json.loads(resp.body), "num_paused_requests": 0})
    return resp


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    """SGLang's format: base64 of a pickled list of (name, tensor); the first entry is used.

    Unpickling runs arbitrary code, exactly as in SGLang: only expose this port to the trainer.
    """
    state = request.app[STATE]
    body = await _body(request)
    blobs = body.get("serialized_named_tensors") if isinstance(body, dict) else None
    if not isinstance(blobs, list) or not blobs or not all(isinstance(b, str) for b in blobs):
        raise InvalidRequest("update_weights_from_tensor takes {'serialized_named_tensors': [str, ...]}")
    refused = _outside_session(state, "update_weights_from_tensor")
    if refused is not None:
        return refused
    try:
        if state.engine.device_type == "cuda":  # pragma: no cover - needs a GPU
            from verst.rollout.engines.cuda_ipc import patch_receiver

            patch_receiver()
        named = dict(pickle.loads(base64.b64decode(blobs[0])))
    except Exception as exc:
        raise InvalidRequest(
            f"cannot deserialize serialized_named_tensors: {type(exc).__name__}: {exc}"
        ) from exc
    return await _apply(state, body, lambda v: state.engine.update_weights_from_tensors(named, v))


async def init_weights_update_group(request: web.Request) -> web.Response:
    """Join the trainer's weight-refit group (the trainer, rank 0, joins at the same time)."""
    body = await _body(request)
    keys = ("master_address", "master_port", "rank_offset", "world_size", "group_name")
    if not isinstance(body, dict) or any(k not in body for k in keys):
        raise InvalidRequest(f"init_weights_update_group takes {{{', '.join(keys)}, 'backend'?}}")
    try:
        await request.app[REFIT].init_group(
            str(body["master_address"]),
            int(body["master_port"]),
            int(body["rank_offset"]),
            int(body["world_size"]),
            str(body["group_name"]),
            str(body.get("backend", "nccl")),
        )
    except InvalidRequest as exc:
        return _failure(str(exc))
    except (RuntimeError, TimeoutError, ValueError) as exc:  # rendezvous failed / timed out / name taken
        return _failure(f"Failed to initialize custom process group: {type(exc).__name__}: {exc}.")
    return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    """Receive every tensor by broadcast from rank 0, then apply them between decode steps."""
    state = request.app[STATE]
    body = await _body(request)
    ok = isinstance(body, dict) and all(isinstance(body.get(k), list) for k in ("names", "dtypes", "shapes"))
    if not ok or not isinstance(body.get("group_name"), str):
        raise InvalidRequest(
            "update_weights_from_distributed takes {'names': [...], 'dtypes': [...], 'shapes': [...], "
            "'group_name': str, 'weight_version'?: str, 'flush_cache'?: bool}"
        )
    refused = _outside_session(state, "update_weights_from_distributed")
    if refused is not None:
        return refused
    refit = request.app[REFIT]

    async def update(version: int) -> int:
        named = await asyncio.to_thread(
            refit.receive, body["group_name"], body["names"], body["dtypes"], body["shapes"]
        )
        return await state.engine.update_weights_from_tensors(named, version)

    return await _apply(state, body, update)


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    body = await _body(request)
    name = body.get("group_name", "weight_update_group") if isinstance(body, dict) else None
    if not isinstance(name, str):
        raise InvalidRequest("destroy_weights_update_group takes {'group_name': str}")
    try:
        request.app[REFIT].destroy(name)
    except InvalidRequest as exc:
        return _failure(str(exc))
    return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})


async def loads(request: web.Request) -> web.Response:
    load = request.app[STATE].engine.load()
    return web.json_response({"loads": [{**load, "dp_rank": 0}]})


def build_app(
    engine: Any,
    *,
    latency: LatencyInjection | None = None,
    info: dict[str, Any] | None = None,
    max_request_tokens: int | None = DEFAULT_MAX_REQUEST_TOKENS,
) -> web.Application:
    """The aiohttp application serving `engine` (an `EmbeddedEngine`) over SGLang's native API.

    A /generate call asking for more than `max_request_tokens` (prompts × n × max_new_tokens;
    None = unbounded) is refused with HTTP 413. On shutdown every request is aborted first (so
    SIGTERM on a busy server exits in seconds), then the engine is closed.
    """
    latency = latency or LatencyInjection()
    latency.rng = random.Random(latency.seed)
    app = web.Application(middlewares=[_errors], client_max_size=1 << 30)
    app[STATE] = _State(engine, dict(info or {}), latency)
    app[REFIT] = DistributedRefit()
    app[MAX_REQUEST_TOKENS] = max_request_tokens
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
    r.add_post("/release_memory_occupation", release_memory_occupation)
    r.add_post("/resume_memory_occupation", resume_memory_occupation)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    r.add_post("/init_weights_update_group", init_weights_update_group)
    r.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    r.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    r.add_post("/begin_weight_update", begin_weight_update)
    r.add_post("/end_weight_update", end_weight_update)
    r.add_get("/v1/loads", loads)
    register_openai_routes(app, engine, **{k: v for k, v in (info or {}).items() if k in OPENAI_ARGS})
    add_lora_routes(app, engine, enabled=bool(app[STATE].info.get("enable_lora")), state=app[STATE])

    async def _close(app: web.Application) -> None:
        app[REFIT].close()
        await app[STATE].engine.close()

    async def _abort_all(app: web.Application) -> None:
        state = app[STATE]
        for event in list(state.delayed.values()):
            event.set()
        try:
            await asyncio.wait_for(state.engine.abort(None), SHUTDOWN_TIMEOUT_S)
        except Exception as exc:  # shutting down anyway
            log.warning("abort on shutdown failed: %s: %s", type(exc).__name__, exc)

    app.on_shutdown.append(_abort_all)
    app.on_cleanup.append(_close)
    return app


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="verst serve",
        description="Serve a Hugging Face causal LM over SGLang's native HTTP API (embedded engine).",
    )
    p.add_argument("--model", "--model-path", dest="model", required=True, help="model directory (HF layout)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port (default 30000)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"], help="device (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-batch-size", type=int, default=64, help="rows decoded together (default 64)")
    p.add_argument("--context-length", type=int, default=None, help="override the model's context length")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--weight-version",
        type=int,
        default=None,
        help='initial weight version (default: reported as "default", read as 0, like SGLang)',
    )
    p.add_argument(
        "--enable-weights-cpu-backup",
        action="store_true",
        help="released weights come back on resume (like SGLang's flag); else a refit must load them",
    )
    p.add_argument(
        "--inject-latency-ms", type=float, default=0.0, help="mean injected delay in ms (default 0)"
    )
    p.add_argument(
        "--inject-latency-fraction", type=float, default=0.0, help="fraction of requests delayed (default 0)"
    )
    p.add_argument("--inject-latency-seed", type=int, default=0, help="seed of the injected delays")
    p.add_argument("--served-model-name", dest="model_name", default=None, help="model id of the OpenAI API")
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=["hermes", "qwen25"],
        help="parse <tool_call> blocks in chat",
    )
    p.add_argument(
        "--max-request-tokens",
        type=int,
        default=DEFAULT_MAX_REQUEST_TOKENS,
        help=f"bound of one /generate call: prompts x n x max_new_tokens; 0 = none (default {DEFAULT_MAX_REQUEST_TOKENS})",
    )
    p.add_argument("--log-level", default="warning", help="logging level (default warning)")
    add_lora_args(p)
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, load the model, serve until SIGINT/SIGTERM."""
    args = make_parser().parse_args(argv)
    if not 0 <= args.inject_latency_fraction <= 1:
        raise SystemExit(f"--inject-latency-fraction must be in [0, 1], got {args.inject_latency_fraction}")
    if not Path(args.model).is_dir():
        raise SystemExit(
            f"verst serve: --model {args.model!r} is not a directory; give a Hugging Face model folder"
        )
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from verst.rollout.engines.embedded import EmbeddedEngine

    engine = EmbeddedEngine.from_pretrained(
        args.model,
        device=args.device,
        dtype=args.dtype,
        tokenizer=args.tokenizer,
        num_threads=args.num_threads,
        max_batch_size=args.max_batch_size,
        context_len=args.context_length,
        weight_version=args.weight_version or 0,
    )
    from verst.rollout.engines.lora_http import configure as configure_lora

    for name, path in configure_lora(engine, args):
        asyncio.run(engine.load_lora_adapter(name, path))
    info = {k: v for k, v in vars(args).items() if k != "log_level"}
    info["model_path"], info["tokenizer_path"] = args.model, args.tokenizer or args.model
    latency = LatencyInjection(args.inject_latency_ms, args.inject_latency_fraction, args.inject_latency_seed)
    app = build_app(engine, latency=latency, info=info, max_request_tokens=args.max_request_tokens or None)
    print(f"verst serve: {args.model} on http://{args.host}:{args.port}", flush=True)
    web.run_app(
        app, host=args.host, port=args.port, print=None, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S
    )


if __name__ == "__main__":
    main()
