"""HTTP plumbing of the vLLM client: one pooled `aiohttp` session, bounded retries, errors
classified as the SGLang client classifies them.

Retryable (tried again with exponential backoff): connection errors, timeouts, any 5xx
(including 503 while a server starts or, on vllm 0.33, while it is paused in `abort`/`wait`
mode). Not retryable, raised at once as `InvalidRequest` with the server's own message: a 4xx
(a bad request, an unknown adapter, a route missing because a server flag is off) and a
malformed URL. A call that exhausts its retries raises `EngineError` naming the URL.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from verst.rollout.engine import EngineError
from verst.rollout.engines.common.errors import InvalidRequest
from verst.rollout.engines.vllm.wire import error_message


class HttpStatusError(InvalidRequest):
    """A 4xx answer, with its status code (the preflight checks tell 403 / 404 apart)."""

    def __init__(self, message: str, status: int, data: Any) -> None:
        super().__init__(message)
        self.status = status
        self.data = data


class _Retryable(Exception):
    """A failure worth retrying (connection error, timeout, 5xx)."""


class HttpCaller:
    """One base URL, one session per event loop, `call(method, path, body)` with retries."""

    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int,
        timeout_s: float,
        connect_timeout_s: float,
        max_retries: int,
        backoff_s: float,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    async def session(self) -> aiohttp.ClientSession:
        """The pooled session of the running loop (a new loop gets a new session)."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            connector = aiohttp.TCPConnector(limit=self.max_connections)
            timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self.connect_timeout_s)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
            self._session_loop = loop
        return self._session

    async def once(self, method: str, path: str, body: Any = None, *, timeout_s: float | None = None) -> Any:
        """One try: the decoded JSON (or text) of a 2xx; `_Retryable` / `HttpStatusError` otherwise."""
        url = f"{self.base_url}{path}"
        session = await self.session()
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else None
        try:
            kwargs: dict[str, Any] = {"json": body} if body is not None else {}
            if timeout is not None:
                kwargs["timeout"] = timeout
            async with session.request(method, url, **kwargs) as resp:
                raw = await resp.read()
                status = resp.status
        except aiohttp.InvalidURL as exc:  # deterministic: retrying cannot help
            raise InvalidRequest(f"{method} {url}: not a valid URL ({exc}); check engine.urls") from exc
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc
        text = raw.decode(errors="replace")
        try:
            data = json.loads(text) if text.strip() else None
        except json.JSONDecodeError:
            data = text
        if status >= 500:
            raise _Retryable(f"HTTP {status}: {str(error_message(data))[:300]}")
        if status >= 400:
            raise HttpStatusError(f"{method} {url} → HTTP {status}: {error_message(data)}", status, data)
        return data

    async def call(self, method: str, path: str, body: Any = None, *, timeout_s: float | None = None) -> Any:
        """`once` with bounded retries for retryable failures only."""
        last = ""
        for attempt in range(self.max_retries + 1):
            try:
                return await self.once(method, path, body, timeout_s=timeout_s)
            except _Retryable as exc:
                last = str(exc)
            if attempt < self.max_retries:
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise EngineError(
            f"{method} {self.base_url}{path} failed after {self.max_retries + 1} attempts "
            f"(last error: {last}); is the vLLM server running and reachable?"
        )

    async def close(self) -> None:
        """Close the session."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None
