"""HTTP with bounded retries, shared by every client of an HTTP engine.

`HttpSettings` is how every HTTP client talks (pool size, bounds, retries), declared once: the
SGLang and vLLM clients and the remote reward model take its fields as keyword arguments
(`HttpOptions`) and hand them to `RetryingHttp`.

One pooled `aiohttp` session per event loop (its connection limit is the client's concurrency);
`call` retries only what retrying can fix (connection errors, timeouts, 5xx including 503 while
a server starts) with exponential backoff, and raises a 4xx at once as `InvalidRequest` carrying
the server's JSON error message (`error_message`: SGLang's `{"error": {"message"}}`, `{"error": str}`
or an OpenAI-style `ErrorResponse`).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, TypedDict

import aiohttp

from verst.rollout.engine import EngineError
from verst.rollout.engines.common.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """The HTTP side of a client: its connection pool, its time bounds and its retries."""

    max_connections: int = 64
    """Pooled connections at most (a client's should equal the rollout's concurrency share)."""
    timeout_s: float = 600.0
    """Bound of one request (one try)."""
    connect_timeout_s: float = 10.0
    """Bound of opening one connection."""
    max_retries: int = 3
    """Retries of a retryable failure (connection error, timeout, 5xx) after the first try."""
    backoff_s: float = 0.5
    """Sleep before retry `k` (from 0): `backoff_s * 2**k`."""


class HttpOptions(TypedDict, total=False):
    """`HttpSettings`' fields as keyword arguments of a client (`**http: Unpack[HttpOptions]`)."""

    max_connections: int
    timeout_s: float
    connect_timeout_s: float
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


class RetryingHttp:
    """A pooled JSON-over-HTTP session with bounded retries for retryable failures only."""

    def __init__(self, settings: HttpSettings | None = None) -> None:
        self.settings = settings or HttpSettings()
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

    async def call(self, method: str, url: str, body: Any = None, *, timeout_s: float | None = None) -> Any:
        """`once` with bounded retries for retryable failures; `RetriesExhausted` (an
        `EngineError`) when they run out."""
        last, retries = "", self.settings.max_retries
        for attempt in range(retries + 1):
            try:
                return await self.once(method, url, body, timeout_s=timeout_s)
            except Retryable as exc:
                last = str(exc)
            if attempt < retries:
                await asyncio.sleep(self.settings.backoff_s * 2**attempt)
        raise RetriesExhausted(
            f"{method} {url} failed after {retries + 1} attempts (last error: {last}); "
            f"is the server running and reachable?",
            retries + 1,
            last,
        )

    async def healthy(self, url: str, timeout_s: float = 5.0) -> bool:
        """GET `url` answered 200 (one try, no retries); a malformed URL is `InvalidRequest`."""
        session = await self.session()
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status == 200
        except aiohttp.InvalidURL as exc:  # deterministic: waiting for it cannot help
            raise InvalidRequest(f"GET {url}: not a valid URL ({exc})") from exc
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def close(self) -> None:
        """Close the session (a later call opens a new one)."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None
