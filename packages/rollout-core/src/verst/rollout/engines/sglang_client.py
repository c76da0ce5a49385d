"""`SGLangClient`: the `InferenceEngine` protocol over SGLang's native HTTP API.

Talks to one SGLang server, a router (sglang-router / model gateway) in front of several, or
`verst serve`. Tokens and log-probs come from `meta_info.output_token_logprobs` (never by
retokenising text). One pooled `aiohttp` session whose connection limit matches the rollout
concurrency; retries with exponential backoff only for retryable failures (connection errors,
timeouts, 5xx including 503 while a server starts) — a 4xx is raised at once with the server's
JSON error. Aborts and weight updates go to every worker directly (workers are listed through
the router: `GET /workers`, or `GET /list_workers` on routers <= 0.2.1); a worker that cannot be
reached is a fatal `EngineError` naming it, never a silent partial abort.

Weight refit: pause → flush → update → continue, and the version the server reports afterwards
is checked. From-disk is tested against `verst serve`; from-tensor (CUDA IPC via SGLang's
serializer) and from-distributed (NCCL group) follow SGLang's contract and await a GPU check.
"""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from verst.rollout.engine import EngineError, GenerateOutput, GenerateRequest
from verst.rollout.engines._common import InvalidRequest
from verst.rollout.engines._wire import parse_output, request_json


class _Retryable(Exception):
    """A failure worth retrying (connection error, timeout, 5xx)."""


class SGLangClient:
    """An async client of one SGLang server or router."""

    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int = 64,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        router: bool = False,
        pause_mode: str = "retract",
        tp_size: int = 1,
    ) -> None:
        """`max_connections` should equal the rollout's max concurrency; `timeout_s` bounds one
        request; a failed retryable call is retried `max_retries` times, sleeping
        `backoff_s * 2**attempt` between tries; `router=True` lists workers through the router
        for aborts and weight updates; `pause_mode` is sent to /pause_generation during a refit."""
        self.base_url = base_url.rstrip("/")
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.router = router
        self.pause_mode = pause_mode
        self.tp_size = tp_size
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"SGLangClient({self.base_url!r}, router={self.router})"

    # ---- HTTP plumbing -----------------------------------------------------------------------
    async def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            connector = aiohttp.TCPConnector(limit=self.max_connections)
            timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self.connect_timeout_s)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
            self._session_loop = loop
        return self._session

    async def _once(self, method: str, url: str, body: Any) -> Any:
        session = await self._get_session()
        try:
            async with session.request(method, url, json=body) as resp:
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
            raise _Retryable(f"HTTP {status}: {text[:300]}")
        if status >= 400:
            message = data.get("error", data) if isinstance(data, dict) else data
            if isinstance(message, dict):
                message = message.get("message", message)
            raise InvalidRequest(f"{method} {url} → HTTP {status}: {message}")
        return data

    async def _call(self, method: str, path: str, body: Any = None, *, base: str | None = None) -> Any:
        """One HTTP call with bounded retries for retryable failures only."""
        url = f"{base or self.base_url}{path}"
        last = ""
        for attempt in range(self.max_retries + 1):
            try:
                return await self._once(method, url, body)
            except _Retryable as exc:
                last = str(exc)
            if attempt < self.max_retries:
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise EngineError(
            f"{method} {url} failed after {self.max_retries + 1} attempts (last error: {last}); "
            f"is the server running and reachable?"
        )

    # ---- generation --------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """POST /generate for one request."""
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
            urls = _worker_urls(data)
            if urls is not None:
                return urls
            errors.append(f"GET {path}: unrecognised body {str(data)[:200]}")
        raise EngineError(f"cannot list the router's workers at {self.base_url}: {'; '.join(errors)}")

    async def abort(self, rid_prefix: str | None = None) -> None:
        """Abort on every worker directly; an unreachable worker is a fatal error naming it."""
        body = {"rid": rid_prefix or "", "abort_all": rid_prefix is None}
        await self._each_worker("abort", lambda url: self._call("POST", "/abort_request", body, base=url))

    async def _each_worker(self, what: str, call: Callable[[str], Awaitable[Any]]) -> list[Any]:
        urls = await self.workers()
        results = await asyncio.gather(*(call(u) for u in urls), return_exceptions=True)
        failed = [(u, r) for u, r in zip(urls, results, strict=True) if isinstance(r, BaseException)]
        if failed:
            detail = "; ".join(f"{u}: {e}" for u, e in failed)
            cls = InvalidRequest if all(isinstance(e, InvalidRequest) for _, e in failed) else EngineError
            raise cls(f"{what} failed on {len(failed)} of {len(urls)} workers ({detail})")
        return list(results)

    # ---- weights -----------------------------------------------------------------------------
    async def get_weight_version(self) -> int:
        """The weight version of the (first) worker, from /model_info."""
        urls = await self.workers()
        info = await self._call("GET", "/model_info", base=urls[0])
        return _version(info, urls[0])

    async def _refit(
        self, what: str, version: int | None, update: Callable[[str, str], Awaitable[Any]]
    ) -> int:
        target = (await self.get_weight_version()) + 1 if version is None else int(version)

        async def one(url: str) -> None:
            await self._call("POST", "/pause_generation", {"mode": self.pause_mode}, base=url)
            try:
                await self._flush(url)
                data = await update(url, str(target))
                if isinstance(data, dict) and data.get("success") is False:
                    raise EngineError(f"{what} on {url} failed: {data.get('message')}")
                got = _version(await self._call("GET", "/model_info", base=url), url)
                if got != target:
                    raise EngineError(
                        f"{what} on {url}: server reports weight version {got}, expected {target}"
                    )
            finally:
                await self._call("POST", "/continue_generation", {}, base=url)

        await self._each_worker(what, one)
        return target

    async def _flush(self, url: str, attempts: int = 20) -> None:
        for _ in range(attempts):
            try:
                await self._call("POST", "/flush_cache", base=url)
                return
            except InvalidRequest:  # 400 while requests still run: wait for the pause to settle
                await asyncio.sleep(0.1)
        raise EngineError(f"flush_cache on {url} kept failing with requests running after pause_generation")

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> int:
        """Refit every worker from a checkpoint directory they can read; returns the version."""

        def update(url: str, version: str) -> Awaitable[Any]:
            body = {"model_path": model_path, "weight_version": version, "flush_cache": True}
            return self._call("POST", "/update_weights_from_disk", body, base=url)

        return await self._refit("update_weights_from_disk", weight_version, update)

    async def update_weights_from_tensors(
        self, named_tensors: dict[str, Any], weight_version: int | None = None
    ) -> int:
        """Refit from in-memory tensors (`/update_weights_from_tensor`).

        CUDA tensors are serialized like SGLang's `MultiprocessingSerializer` (CUDA IPC handles:
        same host only; unverified here without a GPU); CPU tensors are pickled by value.
        """
        blob = serialize_named_tensors(named_tensors)

        def update(url: str, version: str) -> Awaitable[Any]:
            body = {
                "serialized_named_tensors": [blob] * self.tp_size,
                "flush_cache": True,
                "weight_version": version,
            }
            return self._call("POST", "/update_weights_from_tensor", body, base=url)

        return await self._refit("update_weights_from_tensor", weight_version, update)

    async def release_memory_occupation(self) -> None:
        """Ask every worker to free its device memory (colocated training; SGLang contract)."""
        await self._each_worker(
            "release_memory_occupation",
            lambda u: self._call("POST", "/release_memory_occupation", {"tags": None}, base=u),
        )

    async def resume_memory_occupation(self) -> None:
        """Ask every worker to take back what `release_memory_occupation` freed."""
        await self._each_worker(
            "resume_memory_occupation",
            lambda u: self._call("POST", "/resume_memory_occupation", {"tags": None}, base=u),
        )

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> None:
        """Join the trainer's NCCL group (SGLang contract; unverified without a GPU)."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        await self._each_worker(
            "init_weights_update_group",
            lambda u: self._call("POST", "/init_weights_update_group", body, base=u),
        )

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: int | None = None,
    ) -> int:
        """Receive a broadcast from the trainer; the trainer broadcasts while this call waits
        (SGLang contract; unverified without a GPU)."""

        def update(url: str, version: str) -> Awaitable[Any]:
            body = {
                "names": names,
                "dtypes": dtypes,
                "shapes": shapes,
                "group_name": group_name,
                "weight_version": version,
            }
            return self._call("POST", "/update_weights_from_distributed", body, base=url)

        return await self._refit("update_weights_from_distributed", weight_version, update)

    # ---- health, close -----------------------------------------------------------------------
    async def health(self) -> bool:
        """GET /health answered 200 (one try, no retries)."""
        session = await self._get_session()
        try:
            async with session.get(f"{self.base_url}/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None


def serialize_named_tensors(named: dict[str, Any]) -> str:
    """base64 of a pickled `[(name, tensor), ...]` — SGLang's format for /update_weights_from_tensor."""
    items = list(named.items())
    if items and all(getattr(t, "is_cuda", False) for _, t in items):
        import io

        from torch.multiprocessing.reductions import ForkingPickler

        buf = io.BytesIO()
        ForkingPickler(buf).dump(items)
        return base64.b64encode(buf.getvalue()).decode()
    return base64.b64encode(pickle.dumps([(n, t.detach().cpu()) for n, t in items])).decode()


def _worker_urls(data: Any) -> list[str] | None:
    if isinstance(data, dict) and isinstance(data.get("urls"), list):
        return [str(u).rstrip("/") for u in data["urls"]]
    if isinstance(data, dict) and isinstance(data.get("workers"), list):
        urls = [w.get("url") if isinstance(w, dict) else w for w in data["workers"]]
        if all(isinstance(u, str) for u in urls):
            return [u.rstrip("/") for u in urls]
    return None


def _version(info: Any, url: str) -> int:
    try:
        return int(info["weight_version"])
    except (TypeError, KeyError, ValueError):
        raise EngineError(f"{url}/model_info has no integer weight_version: {str(info)[:200]}") from None
