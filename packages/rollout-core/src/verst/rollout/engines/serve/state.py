"""`verst serve`'s per-app state and HTTP plumbing: the state SGLang's protocol keeps (version
label, weight-update session, released memory), injected latency, the app keys, and the error
shapes (SGLang's `ErrorResponse`, /generate's `{"error": {"message"}}`, the middleware that turns
exceptions into them).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from aiohttp import web

from verst.rollout.engine import EngineError
from verst.rollout.engines.common.errors import InvalidRequest
from verst.rollout.engines.common.weight_group import DistributedRefit

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


class ServerState:
    """Per-app state: the engine, server args, delayed requests waiting to be aborted, and the
    protocol state SGLang keeps (version label, weight-update session, released memory)."""

    def __init__(self, engine: Any, info: dict[str, Any], latency: LatencyInjection) -> None:
        self.engine = engine
        self.info = info
        self.latency = latency
        self.delayed: dict[str, asyncio.Event] = {}
        self.stopping = False
        """The server is shutting down: every request still to reach the engine is answered as
        aborted at once (so none starts generating after the shutdown abort)."""
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
        self.startup_time = time.time()
        """When this server started (SGLang's `/server_info` field: a restart changes it)."""

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


STATE = web.AppKey("verst_state", ServerState)
REFIT = web.AppKey("verst_distributed_refit", DistributedRefit)
MAX_REQUEST_TOKENS = web.AppKey("verst_max_request_tokens", object)
DEFAULT_MAX_REQUEST_TOKENS = 1 << 20
"""Default bound of one /generate call: Σ n × (prompt + max_new_tokens) (`--max-request-tokens`)."""
MAX_REQUEST_SEQUENCES = web.AppKey("verst_max_request_sequences", object)
DEFAULT_MAX_REQUEST_SEQUENCES = 4096
"""Default bound of one /generate call's sequences, prompts × n (`--max-request-sequences`)."""
SHUTDOWN_TIMEOUT_S = 3.0
"""Seconds SIGTERM/SIGINT wait for handlers after aborting every request, before exiting; also
the bound on the engine worker's last step when the engine is closed."""


def error_response(status: int, message: str) -> web.Response:
    """SGLang's `ErrorResponse` body (what FastAPI validation and HTTP errors return)."""
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else str(status)
    body = {"object": "error", "message": message, "type": phrase, "param": None, "code": status}
    return web.json_response(body, status=status)


def generate_error(message: str, status: int = 400, *, schema: bool = False) -> web.Response:
    """SGLang's /generate error bodies: a schema violation (wrong type, unknown key) is its
    contract gate's `{"error": "<text>"}`; any other refusal `_create_error_response`'s
    `{"error": {"message"}}`."""
    return web.json_response({"error": message if schema else {"message": message}}, status=status)


def failure(message: str, status: int = 400) -> web.Response:
    """SGLang's control-endpoint failure: `{"success": false, "message"}` with HTTP 400."""
    return web.json_response({"success": False, "message": message}, status=status)


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every failure becomes a JSON error; nothing escapes to kill the server."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason or str(exc))
    except InvalidRequest as exc:
        return error_response(getattr(exc, "status", 400), str(exc))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return error_response(400, f"malformed JSON body: {exc}")
    except EngineError as exc:
        return error_response(503, str(exc))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a bug: report it as JSON, keep serving
        log.exception("unhandled error in %s", request.path)
        return error_response(500, f"{type(exc).__name__}: {exc}")


async def read_body(request: web.Request) -> Any:
    raw = await request.read()
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except RecursionError:
        raise InvalidRequest("malformed JSON body: nested too deeply") from None
