"""`verst serve`: memory occupation and weight updates, with SGLang 0.5.23's session rules
(tensor and distributed updates only inside `/begin_weight_update` … `/end_weight_update`,
released memory refused until resumed, released weights back only with a CPU backup)."""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
from typing import Any

from aiohttp import web

from verst.rollout.engine import WeightBucket, WeightGroupSpec
from verst.rollout.engines.common.errors import InvalidRequest
from verst.rollout.engines.serve.state import (
    MEMORY_TAGS,
    REFIT,
    STATE,
    ServerState,
    failure,
    read_body,
)


def _memory_tags(body: Any) -> set[str]:
    tags = body.get("tags") if isinstance(body, dict) else None
    if tags is None or tags == []:
        return set(MEMORY_TAGS)  # SGLang: no tags = everything, the weights included
    if not isinstance(tags, list) or not all(t in MEMORY_TAGS for t in tags):
        raise InvalidRequest(f"tags must be null or a list of {list(MEMORY_TAGS)}, got {tags!r}")
    return set(tags)


async def release_memory_occupation(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tags = _memory_tags(await read_body(request))
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
    tags = _memory_tags(await read_body(request))
    if "weights" in tags and "weights" in state.released and not state.cpu_backup:
        state.weights_lost = True  # the memory comes back, its contents do not
    state.released -= tags
    await state.engine.resume_memory()
    return web.json_response({})


async def begin_weight_update(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_body(request)
    selector = body.get("selector", "all") if isinstance(body, dict) else None
    if selector not in ("target", "draft", "all"):
        raise InvalidRequest(f"selector must be 'target', 'draft' or 'all', got {selector!r}")
    if state.session_open:
        return failure("a weight-update session is already open; call end_weight_update() first")
    state.session_open = True
    return web.json_response({"success": True, "message": "Success"})


async def end_weight_update(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.session_open:
        return failure("no weight-update session is open; call begin_weight_update() first")
    state.session_open = False
    return web.json_response({"success": True, "message": "Success"})


def _outside_session(state: ServerState, what: str) -> web.Response | None:
    if state.session_open:
        return None
    return failure(f"{what} must run between begin_weight_update() and end_weight_update()")


async def _apply(state: ServerState, body: dict[str, Any], update: Any) -> web.Response:
    """Run one refit call: refuse released weights, keep the version unless one is given."""
    engine = state.engine
    if "weights" in state.released:
        return failure("the weights are released (/release_memory_occupation); resume 'weights' first")
    requested = _version_arg(body)
    try:
        version = await update(engine.weight_version if requested is None else requested)
    except InvalidRequest as exc:
        return failure(str(exc))
    state.weights_lost = False
    if requested is not None:
        state.version_set = True
    if body.get("flush_cache", True) and not engine.flush_cache():
        return failure(
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
    body = await read_body(request)
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
    body = await read_body(request)
    blobs = body.get("serialized_named_tensors") if isinstance(body, dict) else None
    if not isinstance(blobs, list) or not blobs or not all(isinstance(b, str) for b in blobs):
        raise InvalidRequest("update_weights_from_tensor takes {'serialized_named_tensors': [str, ...]}")
    refused = _outside_session(state, "update_weights_from_tensor")
    if refused is not None:
        return refused
    try:
        if state.engine.device_type == "cuda":  # pragma: no cover - needs a GPU
            from verst.rollout.engines.common.cuda_ipc import patch_receiver

            patch_receiver()
        named = dict(pickle.loads(base64.b64decode(blobs[0])))
    except Exception as exc:
        raise InvalidRequest(
            f"cannot deserialize serialized_named_tensors: {type(exc).__name__}: {exc}"
        ) from exc
    return await _apply(state, body, lambda v: state.engine.update_weights_from_tensors(named, v))


async def init_weights_update_group(request: web.Request) -> web.Response:
    """Join the trainer's weight-refit group (the trainer, rank 0, joins at the same time)."""
    body = await read_body(request)
    keys = ("master_address", "master_port", "rank_offset", "world_size", "group_name")
    if not isinstance(body, dict) or any(k not in body for k in keys):
        raise InvalidRequest(f"init_weights_update_group takes {{{', '.join(keys)}, 'backend'?}}")
    try:
        group = WeightGroupSpec(
            str(body["master_address"]),
            int(body["master_port"]),
            int(body["rank_offset"]),
            int(body["world_size"]),
            str(body["group_name"]),
            str(body.get("backend", "nccl")),
        )
        await request.app[REFIT].init_group(group)
    except InvalidRequest as exc:
        return failure(str(exc))
    except (RuntimeError, TimeoutError, ValueError) as exc:  # rendezvous failed / timed out / name taken
        return failure(f"Failed to initialize custom process group: {type(exc).__name__}: {exc}.")
    return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    """Receive every tensor by broadcast from rank 0, then apply them between decode steps."""
    state = request.app[STATE]
    body = await read_body(request)
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
    bucket = WeightBucket(body["names"], body["dtypes"], body["shapes"], body["group_name"])

    async def update(version: int) -> int:
        named = await asyncio.to_thread(refit.receive, bucket)
        return await state.engine.update_weights_from_tensors(named, version)

    return await _apply(state, body, update)


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    body = await read_body(request)
    name = body.get("group_name", "weight_update_group") if isinstance(body, dict) else None
    if not isinstance(name, str):
        raise InvalidRequest("destroy_weights_update_group takes {'group_name': str}")
    try:
        request.app[REFIT].destroy(name)
    except InvalidRequest as exc:
        return failure(str(exc))
    return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})


def add_weight_routes(app: web.Application) -> None:
    """Memory occupation and weight-update routes (disk, tensor, distributed, sessions), each a
    POST at `/<its handler's name>` (SGLang's paths)."""
    handlers = (
        release_memory_occupation,
        resume_memory_occupation,
        update_weights_from_disk,
        update_weights_from_tensor,
        init_weights_update_group,
        update_weights_from_distributed,
        destroy_weights_update_group,
        begin_weight_update,
        end_weight_update,
    )
    for handler in handlers:
        app.router.add_post(f"/{handler.__name__}", handler)
