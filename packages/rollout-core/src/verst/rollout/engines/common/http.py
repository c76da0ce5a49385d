"""HTTP with bounded retries, shared by every client of an HTTP engine.

`HttpSettings` is how every HTTP client talks (pool size, bounds, retries), declared once: the
SGLang and vLLM clients and the remote reward model take its fields as keyword arguments
(`HttpOptions`) and hand them to `RetryingHttp`.

Engine clients build theirs with `engine_bounds(settings)`: then every call has one bound from
the config for the whole call, retries included — `timeout_s` (engine.request_timeout_s) for
generation, `refit_timeout_s` for every weight-sync, LoRA and memory route, `control_timeout_s`
for the rest (abort, pause/continue, versions, worker lists), `health_timeout_s` for a health
probe — and a call still unanswered (no answer, half a body, a refit that stalls) when its
bound runs out raises `EngineTimeout`, one line naming the engine, the route and the bound.

One pooled `aiohttp` session per event loop (its connection limit is the client's concurrency);
`call` retries only what retrying can fix (connection errors, timeouts, 5xx including 503 while
a server starts) with exponential backoff, and raises a 4xx at once as `InvalidRequest` carrying
the server's JSON error message (`error_message`: SGLang's `{"error": {"message"}}`, `{"error": str}`
or an OpenAI-style `ErrorResponse`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypedDict
from urllib.parse import urlsplit

import aiohttp

from verst.rollout.engine import EngineError, EngineTimeout
from verst.rollout.engines.common.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """The HTTP side of a client: its connection pool, its time bounds and its retries."""

    max_connections: int = 64
    """Pooled connections at most (a client's should equal the rollout's concurrency share)."""
    timeout_s: float = 600.0
    """Bound of one request (one try; with `engine_bounds`: of one generate call, retries included)."""
    connect_timeout_s: float = 10.0
    """Bound of opening one connection."""
    control_timeout_s: float = 60.0
    """`engine_bounds`: of one control call (abort, pause/continue, versions, worker lists)."""
    refit_timeout_s: float = 600.0
    """`engine_bounds`: of one weight-sync, LoRA or memory call."""
    health_timeout_s: float = 5.0
    """Of one health probe."""
    max_retries: int = 3
    """Retries of a retryable failure (connection error, timeout, 5xx) after the first try."""
    backoff_s: float = 0.5
    """Sleep before retry `k` (from 0): `backoff_s * 2**k`."""


class HttpOptions(TypedDict, total=False):
    """`HttpSettings`' fields as keyword arguments of a client (`**http: Unpack[HttpOptions]`)."""

    max_connections: int
    timeout_s: float
    connect_timeout_s: float
    control_timeout_s: float
    refit_timeout_s: float
    health_timeout_s: float
    max_retries: int
    backoff_s: float


class RetriesExhausted(EngineError):
    """Every try of a retryable call failed (`attempts` of them; `last`: the last failure)."""

    def __init__(self, message: str, attempts: int, last: str) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.last = last


class Retryable(Exception):
    """A failure worth retrying (connection error, timeout, 5xx)."""


class HttpStatusError(InvalidRequest):
    """A 4xx answer: `InvalidRequest` with the status code and the decoded body (a client that
    tells a missing route, 404, from a refused request, 400, reads `status`)."""

    def __init__(self, message: str, status: int, data: Any) -> None:
        super().__init__(message)
        self.status = status
        self.data = data


def error_message(data: Any) -> Any:
    """The message of an error body: `{"error": {"message"}}` (SGLang, vLLM's `ErrorResponse`),
    `{"error": str}`, an OpenAI-style `{"object": "error", "message", ...}`, or FastAPI's
    `{"detail": ...}`."""
    if not isinstance(data, dict):
        return data
    err = data.get("error")
    if isinstance(err, dict):
        return err.get("message", err)
    if err is not None:
        return err
    for key in ("message", "detail"):
        if key in data:
            return data[key]
    return data


CallKind = Literal["generate", "refit", "control", "health"]
"""Which bound an engine call has (`engine_bounds`)."""

REFIT_ROUTES = (
    "update_weights",  # SGLang's /update_weights_from_{disk,tensor,distributed}, vLLM's /update_weights
    "weight_update",  # /begin_weight_update, /end_weight_update, /start_..., /finish_...
    "weights_update_group",  # /init_weights_update_group, /destroy_weights_update_group
    "weight_transfer",  # vLLM's /init_weight_transfer_engine
    "update_weight_version",
    "collective_rpc",  # vLLM's reload_weights
    "lora_adapter",  # /load_lora_adapter(_from_tensors), /unload_lora_adapter
    "memory_occupation",  # /release_memory_occupation, /resume_memory_occupation
)
"""Path fragments of the weight-sync, LoRA and memory routes (SGLang, vLLM, `verst serve`)."""
GENERATE_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
"""Path endings of the generation routes (SGLang's and `verst serve`'s, vLLM's tokens route)."""


@dataclass(frozen=True, slots=True)
class CallBound:
    """The bound of one engine call and the config field that sets it."""

    seconds: float
    key: str


def route_kind(path: str) -> CallKind:
    """The kind of an engine route: generate, refit (weights, LoRA, memory) or control."""
    path = path.split("?", 1)[0]
    if path.endswith(GENERATE_ROUTES):
        return "generate"
    return "refit" if any(part in path for part in REFIT_ROUTES) else "control"


def engine_bounds(settings: HttpSettings) -> Callable[[str, CallKind | None], CallBound]:
    """An engine client's bounds: route (and an explicit kind) → its `CallBound`."""
    table = {
        "generate": CallBound(settings.timeout_s, "engine.request_timeout_s"),
        "refit": CallBound(settings.refit_timeout_s, "engine.refit_timeout_s"),
        "control": CallBound(settings.control_timeout_s, "engine.control_timeout_s"),
        "health": CallBound(settings.health_timeout_s, "engine.health_timeout_s"),
    }
    return lambda path, kind=None: table[kind or route_kind(path)]


def timed_out(method: str, url: str, bound: CallBound, last: str = "") -> EngineTimeout:
    """The one-line error of an engine call that ran past its bound (`last`: the last
    retryable failure before it, if any)."""
    parts = urlsplit(url)
    route = parts.path + (f"?{parts.query}" if parts.query else "")
    before = f" (after retries; last error: {' '.join(last.split())[:200]})" if last else ""
    return EngineTimeout(
        f"engine {parts.scheme}://{parts.netloc}: {method} {route} got no complete answer within "
        f"{bound.seconds:g}s ({bound.key} = {bound.seconds:g}){before}; the server is stalled or "
        f"overloaded: check it (its log), or raise {bound.key}"
    )


class RetryingHttp:
    """A pooled JSON-over-HTTP session with bounded retries for retryable failures only."""

    def __init__(
        self,
        settings: HttpSettings | None = None,
        *,
        bounds: Callable[[str, CallKind | None], CallBound] | None = None,
    ) -> None:
        """`bounds` (engine clients: `engine_bounds(settings)`): each call is bounded as a whole,
        retries included, and raises `EngineTimeout` past it; without it each try is bounded
        by `settings.timeout_s` (a timeout is retried)."""
        self.settings = settings or HttpSettings()
        self.bounds = bounds
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    async def session(self) -> aiohttp.ClientSession:
        """The session of the running loop (a new one after the loop changed or it was closed)."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            s = self.settings
            connector = aiohttp.TCPConnector(limit=s.max_connections)
            timeout = aiohttp.ClientTimeout(total=s.timeout_s, sock_connect=s.connect_timeout_s)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
            self._session_loop = loop
        return self._session

    async def once(self, method: str, url: str, body: Any, *, timeout_s: float | None = None) -> Any:
        """One try: the decoded JSON body (or its text); `Retryable` or `HttpStatusError` (an
        `InvalidRequest`) on failure. `timeout_s` replaces the session's bound for this call."""
        session = await self.session()
        extra: dict[str, Any] = (
            {} if timeout_s is None else {"timeout": aiohttp.ClientTimeout(total=timeout_s)}
        )
        try:
            async with session.request(method, url, json=body, **extra) as resp:
                raw = await resp.read()
                status = resp.status
        except aiohttp.InvalidURL as exc:  # deterministic: retrying cannot help
            raise InvalidRequest(f"{method} {url}: not a valid URL ({exc}); check engine.urls") from exc
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
            raise Retryable(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc
        text = raw.decode(errors="replace")
        try:
            data = json.loads(text) if text.strip() else None
        except json.JSONDecodeError:
            data = text
        if status >= 500:
            raise Retryable(f"HTTP {status}: {text[:300]}")
        if status >= 400:
            raise HttpStatusError(f"{method} {url} → HTTP {status}: {error_message(data)}", status, data)
        return data

    async def call(
        self,
        method: str,
        url: str,
        body: Any = None,
        *,
        timeout_s: float | None = None,
        kind: CallKind | None = None,
    ) -> Any:
        """`once` with bounded retries for retryable failures; `RetriesExhausted` (an
        `EngineError`) when they run out. With `bounds`, the whole call has the bound of its
        route (or of `kind`) and `EngineTimeout` is raised past it (`timeout_s` is then unused)."""
        if self.bounds is not None:
            return await self._bounded(method, url, body, self.bounds(urlsplit(url).path, kind))
        last, retries = "", self.settings.max_retries
        for attempt in range(retries + 1):
            try:
                return await self.once(method, url, body, timeout_s=timeout_s)
            except Retryable as exc:
                last = str(exc)
            if attempt < retries:
                await asyncio.sleep(self.settings.backoff_s * 2**attempt)
        raise self._exhausted(method, url, last)

    async def _bounded(self, method: str, url: str, body: Any, bound: CallBound) -> Any:
        """`call` under one deadline for every try and the waits between them. Each try runs
        under its own `asyncio.timeout` of what is left (aiohttp's timer, a backstop, fires
        later: when both fire at once aiohttp may turn the cancellation into its own timeout)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bound.seconds
        last, retries = "", self.settings.max_retries
        for attempt in range(retries + 1):
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                async with asyncio.timeout(left):
                    return await self.once(method, url, body, timeout_s=left + 1.0)
            except TimeoutError:
                raise timed_out(method, url, bound) from None
            except Retryable as exc:
                last = str(exc)
            if attempt < retries:
                await asyncio.sleep(min(self.settings.backoff_s * 2**attempt, max(deadline - loop.time(), 0)))
        if loop.time() >= deadline:
            raise timed_out(method, url, bound, last)
        raise self._exhausted(method, url, last)

    def _exhausted(self, method: str, url: str, last: str) -> RetriesExhausted:
        retries = self.settings.max_retries
        return RetriesExhausted(
            f"{method} {url} failed after {retries + 1} attempts (last error: {last}); "
            f"is the server running and reachable?",
            retries + 1,
            last,
        )

    async def healthy(self, url: str, timeout_s: float | None = None) -> bool:
        """GET `url` answered 200 (one try, no retries, bounded by `timeout_s`, default the
        health bound); a malformed URL is `InvalidRequest`. With `bounds`, a probe the server
        accepts and never answers raises `EngineTimeout` (it is not merely unhealthy)."""
        bound = CallBound(self.settings.health_timeout_s, "engine.health_timeout_s")
        if self.bounds is not None:
            bound = self.bounds(urlsplit(url).path, "health")
        seconds = bound.seconds if timeout_s is None else timeout_s
        session = await self.session()
        try:
            async with asyncio.timeout(seconds):
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=seconds)) as resp:
                    await resp.read()
                    return resp.status == 200
        except aiohttp.InvalidURL as exc:  # deterministic: waiting for it cannot help
            raise InvalidRequest(f"GET {url}: not a valid URL ({exc})") from exc
        except TimeoutError:
            if self.bounds is None:
                return False
            raise timed_out("GET", url, CallBound(seconds, bound.key)) from None
        except aiohttp.ClientError:
            return False

    async def close(self) -> None:
        """Close the session (a later call opens a new one)."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None
