"""HTTP of the vLLM client: the shared `RetryingHttp` (`verst.rollout.engines.common.http`) bound
to one server's base URL.

Errors are classified as for every HTTP engine: connection errors, timeouts and any 5xx
(including 503 while a server starts or, on vllm 0.33, while it is paused in `abort`/`wait` mode)
are retried with exponential backoff, within the call's bound (`engine_bounds`); a 4xx is
raised at once as `HttpStatusError` (an
`InvalidRequest` carrying the status, which the pre-run checks read: 403 = a server flag is off,
404 = a route is missing) with vLLM's own message; a call that exhausts its retries raises
`EngineError` naming the URL.
"""

from __future__ import annotations

from typing import Any

from verst.rollout.engines.common.http import (
    CallKind,
    HttpSettings,
    HttpStatusError,
    RetryingHttp,
    engine_bounds,
)

__all__ = ["HttpCaller", "HttpStatusError"]


class HttpCaller:
    """`call(method, path, body)` against one base URL, with the shared retries."""

    def __init__(self, base_url: str, settings: HttpSettings) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = RetryingHttp(settings, bounds=engine_bounds(settings))

    async def once(self, method: str, path: str, body: Any = None, *, timeout_s: float | None = None) -> Any:
        """One try (no retries)."""
        return await self.http.once(method, f"{self.base_url}{path}", body, timeout_s=timeout_s)

    async def call(self, method: str, path: str, body: Any = None, *, kind: CallKind | None = None) -> Any:
        """With retries for retryable failures only, within the bound of the route's kind (or
        of `kind`): `EngineTimeout` past it."""
        return await self.http.call(method, f"{self.base_url}{path}", body, kind=kind)

    async def healthy(self, path: str = "/health") -> bool:
        """`GET path` answered 200 (one try)."""
        return await self.http.healthy(f"{self.base_url}{path}")

    async def close(self) -> None:
        """Close the session."""
        await self.http.close()
