"""`verst serve`'s LoRA endpoints and launch flags, as SGLang 0.5.23 has them.

Flags: `--enable-lora`, `--max-lora-rank`, `--lora-target-modules`, `--max-loras-per-batch`,
`--lora-paths NAME=PATH ...` (preloaded). Endpoints: `/load_lora_adapter`,
`/load_lora_adapter_from_tensors`, `/unload_lora_adapter` (answer `LoRAUpdateOutput`:
`{success, error_message, loaded_adapters}`, HTTP 400 when `success` is false) and
`/update_weight_version`. As in SGLang, loading a name already loaded fails (unload it first),
and the LoRA endpoints answer "LoRA is not enabled" without `--enable-lora`.

`--max-loras-per-batch` is accepted and reported; the embedded engine decodes rows of any
number of adapters in one batch, so it does not limit anything here.
"""

from __future__ import annotations

import argparse
import base64
import json
import pickle
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from verst.rollout.engines.common.errors import InvalidRequest

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
LORA = web.AppKey("verst_lora_enabled", bool)
ENGINE = web.AppKey("verst_lora_engine", object)
SERVER_STATE = web.AppKey("verst_lora_server_state", object)
Handler = Callable[[web.Request], Awaitable[web.Response]]


async def _body(request: web.Request) -> Any:
    raw = await request.read()
    return json.loads(raw) if raw else {}


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """SGLang's LoRA launch flags."""
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (SGLang's flag)")
    p.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank accepted")
    p.add_argument("--lora-target-modules", nargs="*", default=None, help="modules adapters may target")
    p.add_argument("--max-loras-per-batch", type=int, default=8, help="accepted for SGLang compatibility")
    p.add_argument("--lora-paths", nargs="*", default=None, help="adapters to preload, NAME=PATH each")


def configure(engine: Any, args: argparse.Namespace) -> list[tuple[str, str]]:
    """Apply the flags to the engine; returns the (name, path) adapters to preload."""
    if args.lora_paths and not args.enable_lora:
        args.enable_lora = True  # SGLang: --lora-paths implies --enable-lora
    engine.lora_max_rank = args.max_lora_rank
    engine.lora_target_modules = args.lora_target_modules
    out = []
    for item in args.lora_paths or []:
        name, sep, path = item.partition("=")
        out.append((name, path) if sep else (item.rstrip("/").rsplit("/", 1)[-1], item))
    return out


def _result(engine: Any, ok: bool, error: str | None = None) -> web.Response:
    body = {"success": ok, "error_message": error, "loaded_adapters": engine.lora_adapters}
    return web.json_response(body, status=200 if ok else 400)


Prepare = Callable[[Any, dict[str, Any]], "Awaitable[Any] | web.Response"]
"""A LoRA endpoint's own part: `(engine, body)` → the engine call to await (or an answer)."""


def _lora_route(*keys: str, new_name: bool = False) -> Callable[[Prepare], Handler]:
    """A LoRA endpoint: refused with SGLang's message unless `--enable-lora`; `keys` must be
    non-empty strings in the body (else `InvalidRequest`, HTTP 400); with `new_name` a loaded
    `lora_name` is refused; then the endpoint's engine call, answered as a `LoRAUpdateOutput`
    (`success: false` when the engine refuses it)."""

    def wrap(prepare: Prepare) -> Handler:
        async def handler(request: web.Request) -> web.Response:
            engine: Any = request.app[ENGINE]
            if not request.app[LORA]:
                return _result(engine, False, NOT_ENABLED)
            body = await _body(request)
            if not isinstance(body, dict) or any(
                not isinstance(body.get(k), str) or not body[k] for k in keys
            ):
                raise InvalidRequest(f"{request.path} takes {{{', '.join(repr(k) for k in keys)}: str, ...}}")
            if new_name and body["lora_name"] in engine.lora_adapters:
                return _result(engine, False, f"LoRA with name {body['lora_name']} already exists.")
            call = prepare(engine, body)
            if isinstance(call, web.Response):
                return call
            try:
                await call
            except InvalidRequest as exc:
                return _result(engine, False, str(exc))
            return _result(engine, True)

        handler.__doc__ = prepare.__doc__
        return handler

    return wrap


@_lora_route("lora_name", "lora_path", new_name=True)
def load_lora_adapter(engine: Any, body: dict[str, Any]) -> Awaitable[Any]:
    return engine.load_lora_adapter(body["lora_name"], body["lora_path"])


@_lora_route("lora_name", new_name=True)
def load_lora_adapter_from_tensors(engine: Any, body: dict[str, Any]) -> Awaitable[Any]:
    """Unpickling runs arbitrary code, as SGLang's payload does: expose this port to the trainer only."""
    blobs, config = body.get("serialized_named_tensors"), body.get("config_dict")
    if (
        not isinstance(blobs, list)
        or not blobs
        or not isinstance(blobs[0], str)
        or not isinstance(config, dict)
    ):
        raise InvalidRequest(
            "load_lora_adapter_from_tensors takes {'lora_name': str, 'config_dict': {...}, "
            "'serialized_named_tensors': [base64 str, ...]}"
        )
    try:
        tensors = pickle.loads(base64.b64decode(blobs[0]))
    except Exception as exc:
        raise InvalidRequest(
            f"cannot deserialize serialized_named_tensors: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(tensors, dict):
        raise InvalidRequest("serialized_named_tensors must hold a {name: tensor} dict")
    return engine.load_lora_adapter_from_tensors(body["lora_name"], tensors, config)


@_lora_route("lora_name")
def unload_lora_adapter(engine: Any, body: dict[str, Any]) -> Awaitable[Any]:
    return engine.unload_lora_adapter(body["lora_name"])


async def update_weight_version(request: web.Request) -> web.Response:
    engine: Any = request.app[ENGINE]
    body = await _body(request)
    version = body.get("new_version") if isinstance(body, dict) else None
    try:
        new = int(version)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return web.json_response(
            {
                "success": False,
                "message": f"new_version must be an integer string in verst serve, got {version!r}",
            },
            status=400,
        )
    if body.get("abort_all_requests", True):
        await engine.abort(None)
    engine.set_weight_version(new)
    state = request.app[SERVER_STATE]
    if state is not None:
        state.version_set = True  # the server now reports this number, not "default"
    return web.json_response(
        {"success": True, "message": f"Weight version updated to {new}", "new_version": str(new)}
    )


def add_lora_routes(app: web.Application, engine: Any, *, enabled: bool, state: Any = None) -> None:
    """Register the LoRA endpoints for `engine` (they refuse with SGLang's message unless
    `enabled`); `state` is the server's protocol state (its weight-version label)."""
    app[LORA] = enabled
    app[ENGINE] = engine
    app[SERVER_STATE] = state
    app.router.add_post("/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/load_lora_adapter_from_tensors", load_lora_adapter_from_tensors)
    app.router.add_post("/unload_lora_adapter", unload_lora_adapter)
    app.router.add_post("/update_weight_version", update_weight_version)
