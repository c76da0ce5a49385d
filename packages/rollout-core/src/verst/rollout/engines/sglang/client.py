"""`SGLangClient`: the `InferenceEngine` protocol over SGLang's native HTTP API.

Talks to one SGLang server, a router (sglang-router / model gateway) in front of several, or
`verst serve`. Tokens and log-probs come from `meta_info.output_token_logprobs` (never by
retokenising text). One pooled `aiohttp` session whose connection limit matches the rollout
concurrency; retries with exponential backoff only for retryable failures (connection errors,
timeouts, 5xx including 503 while a server starts) — a 4xx is raised at once with the server's
JSON error (SGLang's `{"error": {"message"}}` or its `ErrorResponse` `{"object": "error",
"message"}`). Aborts and weight updates go to every worker directly (workers are listed through
the router: `GET /workers` on sglang-router 0.3.x, `GET /list_workers` on <= 0.2.1; a dp-aware
worker URL's `@rank` suffix is dropped); a worker that cannot be reached is a fatal `EngineError`
naming it, never a silent partial abort.

Aborts: SGLang looks a rid up exactly (a prefix matches nothing), so the client remembers the rid
of every request in flight and `abort(prefix)` sends one exact `/abort_request` per matching rid
(re-sent once for any still running a moment later); `abort(None)` is `abort_all`.

Weight refits and memory occupation: `SGLangWeightsMixin` (`refit`); LoRA: `SGLangLoraMixin`
(`lora`); HTTP with retries: `RetryingHttp` (`verst.rollout.engines.common.http`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Unpack

from verst.rollout.engine import EngineError, GenerateOutput, GenerateRequest
from verst.rollout.engines.common.aborts import AbortResends, InFlight
from verst.rollout.engines.common.errors import InvalidRequest
from verst.rollout.engines.common.http import (
    HttpOptions,
    HttpSettings,
    RetryingHttp,
    engine_bounds,
    error_message,
)
from verst.rollout.engines.common.wire import parse_output, request_json, worker_urls
from verst.rollout.engines.sglang.lora import SGLangLoraMixin
from verst.rollout.engines.sglang.refit import (
    ALL_MEMORY_TAGS,
    DEFAULT_BUCKET_BYTES,
    SGLangWeightsMixin,
    first_stall,
    serialize_named_tensors,
)

__all__ = [
    "ALL_MEMORY_TAGS",
    "DEFAULT_BUCKET_BYTES",
    "SGLangClient",
    "error_message",
    "serialize_named_tensors",
    "worker_urls",
]


class SGLangClient(SGLangWeightsMixin, SGLangLoraMixin):
    """An async client of one SGLang server or router (weights: `SGLangWeightsMixin`, LoRA: `SGLangLoraMixin`)."""

    def __init__(
        self,
        base_url: str,
        *,
        router: bool = False,
        pause_mode: str = "retract",
        tp_size: int = 1,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        abort_resend_s: float = 0.5,
        **http: Unpack[HttpOptions],
    ) -> None:
        """`http`: the `HttpSettings` fields (`max_connections` should equal the rollout's max
        concurrency; retries only for retryable failures); `router=True` lists workers through the router
        for aborts and weight updates; `pause_mode` is sent to /pause_generation during a refit;
        `tp_size` is each worker's GPU count when its /server_info does not say; `bucket_bytes`
        bounds one refit call; `abort_resend_s`: exact aborts are re-sent after this delay (then
        after 2x and 4x it) for requests still in flight (a request may reach the server just
        after its abort)."""
        self.base_url = base_url.rstrip("/")
        self.http_settings = HttpSettings(**http)
        self.router = router
        self.pause_mode = pause_mode
        self.tp_size = tp_size
        self.bucket_bytes = bucket_bytes
        self._inflight = InFlight()
        """rid → requests in flight with it (for exact aborts)."""
        self._held = False
        """Memory is released: refits leave generation paused until it is resumed."""
        self._resends = AbortResends(self._inflight, self._abort_exact, abort_resend_s)
        """Background re-sends of exact aborts (cancelled on close)."""
        self._http = RetryingHttp(self.http_settings, bounds=engine_bounds(self.http_settings))
        """Every call bounded as a whole by its route's bound (`common.http.engine_bounds`)."""

    def __repr__(self) -> str:
        return f"SGLangClient({self.base_url!r}, router={self.router})"

    # ---- HTTP plumbing -----------------------------------------------------------------------
    async def _call(self, method: str, path: str, body: Any = None, *, base: str | None = None) -> Any:
        """One HTTP call with bounded retries for retryable failures only."""
        return await self._http.call(method, f"{base or self.base_url}{path}", body)

    # ---- generation --------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """POST /generate for one request."""
        with self._inflight.track([request.rid]):
            data = await self._call("POST", "/generate", request_json(request))
        if isinstance(data, list):
            data = data[0]
        return parse_output(data, request)

    async def generate_batch(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        """One /generate call carrying several prompts (SGLang batch form)."""
        if not requests:
            return []
        bodies = [request_json(r) for r in requests]
        first = bodies[0]
        shared = ("return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob")
        if any(any(b.get(k) != first.get(k) for k in shared) for b in bodies):
            raise InvalidRequest("generate_batch: log-prob options must be the same for every request")
        body = {k: first[k] for k in shared if k in first}
        body["input_ids"] = [b["input_ids"] for b in bodies]
        body["sampling_params"] = [b["sampling_params"] for b in bodies]
        if all(r.rid for r in requests):
            body["rid"] = [r.rid for r in requests]
        if any(r.lora_path is not None for r in requests):
            body["lora_path"] = [r.lora_path for r in requests]
        with self._inflight.track([r.rid for r in requests]):
            data = await self._call("POST", "/generate", body)
        if not isinstance(data, list) or len(data) != len(requests):
            raise EngineError(
                f"batch /generate returned {type(data).__name__}, expected {len(requests)} results"
            )
        return [parse_output(d, r) for d, r in zip(data, requests, strict=True)]

    # ---- workers, abort ----------------------------------------------------------------------
    async def workers(self) -> list[str]:
        """Worker URLs: the router's list, or just this server."""
        if not self.router:
            return [self.base_url]
        errors = []
        for path in ("/workers", "/list_workers"):
            try:
                data = await self._call("GET", path)
            except (InvalidRequest, EngineError) as exc:
                errors.append(str(exc))
                continue
            urls = worker_urls(data)
            if urls is not None:
                return urls
            errors.append(f"GET {path}: unrecognised body {str(data)[:200]}")
        raise EngineError(f"cannot list the router's workers at {self.base_url}: {'; '.join(errors)}")

    async def abort(self, rid_prefix: str | None = None) -> None:
        """Abort on every worker directly: `None` aborts all; otherwise each in-flight rid that
        starts with `rid_prefix` is aborted exactly (SGLang ignores prefixes). An unreachable
        worker is a fatal error naming it."""
        if rid_prefix is None:
            body = {"rid": "", "abort_all": True}
            await self._each_worker("abort", lambda url: self._call("POST", "/abort_request", body, base=url))
            return
        rids = self._inflight.matching(rid_prefix)
        await self._abort_exact(rids)
        self._resends.schedule(rids)

    async def _abort_exact(self, rids: list[str]) -> None:
        if not rids:
            return

        async def on(url: str) -> None:
            for rid in rids:
                await self._call("POST", "/abort_request", {"rid": rid, "abort_all": False}, base=url)

        await self._each_worker("abort", on)

    async def _each_worker(self, what: str, call: Callable[[str], Awaitable[Any]]) -> list[Any]:
        urls = await self.workers()
        results = await asyncio.gather(*(call(u) for u in urls), return_exceptions=True)
        failed = [(u, r) for u, r in zip(urls, results, strict=True) if isinstance(r, BaseException)]
        if failed:
            first_stall(failed)
            detail = "; ".join(f"{u}: {e}" for u, e in failed)
            cls = InvalidRequest if all(isinstance(e, InvalidRequest) for _, e in failed) else EngineError
            raise cls(f"{what} failed on {len(failed)} of {len(urls)} workers ({detail})")
        return list(results)

    # ---- health, close -----------------------------------------------------------------------
    async def health(self) -> bool:
        """GET /health answered 200 (one try, no retries); a malformed URL is `InvalidRequest`."""
        return await self._http.healthy(f"{self.base_url}/health")

    async def close(self) -> None:
        """Cancel pending abort re-sends; close the HTTP session."""
        self._resends.cancel()
        await self._http.close()
