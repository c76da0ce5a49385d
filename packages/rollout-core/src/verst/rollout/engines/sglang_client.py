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

Weight refit (SGLang 0.5.23): pause → flush → `/begin_weight_update` → update in buckets bounded
by bytes (`flush_cache` only with the last) → `/end_weight_update` → continue; the version the
server reports afterwards is checked. A fresh server's version `"default"` reads as 0. CUDA
tensors travel as CUDA IPC handles (SGLang's device-uuid reduction patch applied on the sender,
one payload per tensor-parallel rank); CPU tensors are pickled by value, one bucket per body (a
real SGLang server's safe unpickler accepts only the CUDA form; `verst serve` takes both).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import pickle
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import aiohttp

from verst.rollout.engine import EngineError, GenerateOutput, GenerateRequest
from verst.rollout.engines._common import InvalidRequest
from verst.rollout.engines._wire import parse_output, request_json
from verst.rollout.engines.lora_client import SGLangLoraMixin

DEFAULT_BUCKET_BYTES = 512 << 20
"""Refit bucket bound: at most this many tensor bytes per update call (one JSON body)."""
ALL_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""SGLang's memory-occupation tags (`sglang.srt.constants.GPU_MEMORY_ALL_TYPES`)."""


class _Retryable(Exception):
    """A failure worth retrying (connection error, timeout, 5xx)."""


ABORT_RESENDS = 3
"""How many times an exact abort is re-sent for requests still in flight (doubling delays)."""


class SGLangClient(SGLangLoraMixin):
    """An async client of one SGLang server or router (LoRA API: `SGLangLoraMixin`)."""

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
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        abort_resend_s: float = 0.5,
    ) -> None:
        """`max_connections` should equal the rollout's max concurrency; `timeout_s` bounds one
        request; a failed retryable call is retried `max_retries` times, sleeping
        `backoff_s * 2**attempt` between tries; `router=True` lists workers through the router
        for aborts and weight updates; `pause_mode` is sent to /pause_generation during a refit;
        `tp_size` is each worker's GPU count when its /server_info does not say; `bucket_bytes`
        bounds one refit call; `abort_resend_s`: exact aborts are re-sent after this delay (then
        after 2x and 4x it) for requests still in flight (a request may reach the server just
        after its abort)."""
        self.base_url = base_url.rstrip("/")
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.router = router
        self.pause_mode = pause_mode
        self.tp_size = tp_size
        self.bucket_bytes = bucket_bytes
        self.abort_resend_s = abort_resend_s
        self._inflight: dict[str, int] = {}
        """rid → requests in flight with it (for exact aborts)."""
        self._held = False
        """Memory is released: refits leave generation paused until it is resumed."""
        self._resends: set[asyncio.Task[None]] = set()
        """Background re-sends of exact aborts (cancelled on close)."""
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
            raise InvalidRequest(f"{method} {url} → HTTP {status}: {error_message(data)}")
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
        with self._track([request.rid]):
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
        with self._track([r.rid for r in requests]):
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
        """Abort on every worker directly: `None` aborts all; otherwise each in-flight rid that
        starts with `rid_prefix` is aborted exactly (SGLang ignores prefixes). An unreachable
        worker is a fatal error naming it."""
        if rid_prefix is None:
            body = {"rid": "", "abort_all": True}
            await self._each_worker("abort", lambda url: self._call("POST", "/abort_request", body, base=url))
            return
        rids = self._matching(rid_prefix)
        await self._abort_exact(rids)
        if rids and self.abort_resend_s > 0:  # in the background: the caller need not wait
            task = asyncio.ensure_future(self._resend(rids))
            self._resends.add(task)
            task.add_done_callback(self._resends.discard)

    async def _resend(self, rids: list[str]) -> None:
        """Re-send the exact aborts while any of `rids` is still in flight: after
        `abort_resend_s`, then twice and four times that (a request can reach a busy server late)."""
        delay = self.abort_resend_s
        for _ in range(ABORT_RESENDS):
            await asyncio.sleep(delay)
            left = [r for r in rids if r in self._inflight]
            if not left:
                return
            with contextlib.suppress(EngineError):  # best effort: the first abort already went out
                await self._abort_exact(left)
            delay *= 2

    def _matching(self, prefix: str) -> list[str]:
        return sorted(r for r in self._inflight if r.startswith(prefix))

    async def _abort_exact(self, rids: list[str]) -> None:
        if not rids:
            return

        async def on(url: str) -> None:
            for rid in rids:
                await self._call("POST", "/abort_request", {"rid": rid, "abort_all": False}, base=url)

        await self._each_worker("abort", on)

    def _track(self, rids: Iterable[str]) -> _Tracked:
        return _Tracked(self._inflight, [r for r in rids if r])

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
        """The weight version of the (first) worker, from /model_info (`"default"` = 0)."""
        urls = await self.workers()
        info = await self._call("GET", "/model_info", base=urls[0])
        return _version(info, urls[0])

    async def begin_weight_update(self) -> None:
        """Open a refit on every worker: pause → flush → `/begin_weight_update`.

        All or nothing: a worker that fails is continued again, and if any failed, the workers
        where the session did open are rolled back (`/end_weight_update`, then continued) before
        the error is raised, so no worker stays paused with an open session.
        """

        async def one(url: str) -> None:
            await self._call("POST", "/pause_generation", {"mode": self.pause_mode}, base=url)
            try:
                await self._flush(url)
                await self._checked("begin_weight_update", url, {"selector": "all"})
            except BaseException:
                await self._continue(url)
                raise

        urls = await self.workers()
        results = await asyncio.gather(*(one(u) for u in urls), return_exceptions=True)
        failed = [(u, r) for u, r in zip(urls, results, strict=True) if isinstance(r, BaseException)]
        if failed:
            begun = [u for u, r in zip(urls, results, strict=True) if not isinstance(r, BaseException)]
            await asyncio.gather(*(self._roll_back(u) for u in begun), return_exceptions=True)
            detail = "; ".join(f"{u}: {e}" for u, e in failed)
            cls = InvalidRequest if all(isinstance(e, InvalidRequest) for _, e in failed) else EngineError
            raise cls(
                f"begin_weight_update failed on {len(failed)} of {len(urls)} workers ({detail}); "
                f"the session was rolled back on the other {len(begun)}"
            )

    async def _roll_back(self, url: str) -> None:
        """Close a session that was opened on `url` and continue it (after another worker failed)."""
        try:
            await self._checked("end_weight_update", url, {})
        finally:
            await self._continue(url)

    async def _continue(self, url: str) -> None:
        """Continue generation unless released memory holds it paused (colocated refit)."""
        if not self._held:
            await self._call("POST", "/continue_generation", {}, base=url)

    async def end_weight_update(self, weight_version: int | None, *, check: bool = True) -> None:
        """Close the refit on every worker: `/end_weight_update`, check the version it reports
        (when `check` and `weight_version` is given), then continue generation (always)."""

        async def one(url: str) -> None:
            try:
                await self._checked("end_weight_update", url, {})
                if check and weight_version is not None:
                    got = _version(await self._call("GET", "/model_info", base=url), url)
                    if got != weight_version:
                        raise EngineError(
                            f"refit on {url}: server reports weight version {got}, expected {weight_version}"
                        )
            finally:
                await self._continue(url)

        await self._each_worker("end_weight_update", one)

    async def _checked(self, what: str, url: str, body: Any) -> Any:
        data = await self._call("POST", f"/{what}", body, base=url)
        if isinstance(data, dict) and data.get("success") is False:
            raise EngineError(f"{what} on {url} failed: {data.get('message')}")
        return data

    async def _refit_session(
        self, what: str, version: int | None, calls: list[Callable[[str, str | None], Awaitable[Any]]]
    ) -> int:
        """pause → flush → begin → each call (the last gets the version) → end → continue."""
        target = (await self.get_weight_version()) + 1 if version is None else int(version)
        await self.begin_weight_update()  # all or nothing: on failure no worker is left in a session
        ok = False
        try:
            for i, call in enumerate(calls):
                last = i == len(calls) - 1
                await self._each_worker(what, lambda url, c=call, v=last: c(url, str(target) if v else None))
            ok = True
        finally:
            await self.end_weight_update(target, check=ok)
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
        """Refit every worker from a checkpoint directory they can read; returns the version.

        pause → flush → update → continue (SGLang needs no begin/end session for disk)."""
        target = (await self.get_weight_version()) + 1 if weight_version is None else int(weight_version)

        async def one(url: str) -> None:
            await self._call("POST", "/pause_generation", {"mode": self.pause_mode}, base=url)
            try:
                await self._flush(url)
                body = {"model_path": model_path, "weight_version": str(target), "flush_cache": True}
                await self._checked("update_weights_from_disk", url, body)
                got = _version(await self._call("GET", "/model_info", base=url), url)
                if got != target:
                    raise EngineError(
                        f"update_weights_from_disk on {url}: server reports weight version {got}, expected {target}"
                    )
            finally:
                await self._continue(url)

        await self._each_worker("update_weights_from_disk", one)
        return target

    async def update_weights_from_tensors(
        self, named_tensors: dict[str, Any], weight_version: int | None = None
    ) -> int:
        """Refit from in-memory tensors (`/update_weights_from_tensor`), in buckets of at most
        `bucket_bytes`, inside one begin/end session; returns the version.

        CUDA tensors go as CUDA IPC handles (same host; SGLang's device-uuid patch applied
        here), serialized once per tensor-parallel rank; CPU tensors are pickled by value.
        """
        from verst.rollout.engines.weight_group import buckets

        sizes = [(n, _nbytes(t)) for n, t in named_tensors.items()]
        tp = await self._worker_gpus()
        calls = []
        for names in buckets(sizes, self.bucket_bytes):
            part = {n: named_tensors[n] for n in names}

            async def call(url: str, version: str | None, part: dict[str, Any] = part) -> Any:
                body: dict[str, Any] = {
                    "serialized_named_tensors": [serialize_named_tensors(part) for _ in range(tp[url])],
                    "flush_cache": version is not None,
                }
                if version is not None:
                    body["weight_version"] = version
                return await self._checked("update_weights_from_tensor", url, body)

            calls.append(call)
        return await self._refit_session("update_weights_from_tensor", weight_version, calls)

    async def _worker_gpus(self) -> dict[str, int]:
        """GPUs (= ranks in a weight group) per worker: `tp_size` from /server_info, else ours."""
        urls = await self.workers()

        async def one(url: str) -> int:
            info = await self._call("GET", "/server_info", base=url)
            tp = info.get("tp_size") if isinstance(info, dict) else None
            return int(tp) if isinstance(tp, int) and tp > 0 else self.tp_size

        return dict(zip(urls, await asyncio.gather(*(one(u) for u in urls)), strict=True))

    async def weight_group_ranks(self) -> int:
        """How many ranks this client's workers take in a weight-update group (Σ GPUs)."""
        return sum((await self._worker_gpus()).values())

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Free device memory on every worker (colocated training): pause (retract) first — SGLang
        asserts the server is idle — then release `tags` (None = every tag, weights included;
        weights come back only if the server runs with `--enable-weights-cpu-backup` or a refit
        loads new ones). Generation stays paused until `resume_memory_occupation` resumes all."""

        async def one(url: str) -> None:
            await self._call("POST", "/pause_generation", {"mode": "retract"}, base=url)
            await self._call("POST", "/release_memory_occupation", {"tags": _tags(tags)}, base=url)

        self._held = True
        await self._each_worker("release_memory_occupation", one)

    async def resume_memory_occupation(
        self, tags: list[str] | None = None, *, continue_generation: bool = True
    ) -> None:
        """Take back `tags` (None = all) on every worker; then continue generation unless told not to
        (resume `weights`, refit, then resume the rest). Until generation continues here, refits
        leave it paused (the KV cache may still be released)."""

        async def one(url: str) -> None:
            await self._call("POST", "/resume_memory_occupation", {"tags": _tags(tags)}, base=url)
            if continue_generation:
                await self._call("POST", "/continue_generation", {}, base=url)

        await self._each_worker("resume_memory_occupation", one)
        if continue_generation:
            self._held = False

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> None:
        """Every worker joins the trainer's group: worker i takes ranks from `rank_offset` plus the
        GPUs of the workers before it (SGLang: server rank = rank_offset + tp_rank)."""
        gpus = await self._worker_gpus()
        offsets, offset = {}, rank_offset
        for url, g in gpus.items():
            offsets[url], offset = offset, offset + g
        if offset > world_size:
            raise InvalidRequest(
                f"init_weights_update_group: the workers need ranks {rank_offset}..{offset - 1} "
                f"but world_size is {world_size}"
            )

        def call(url: str) -> Awaitable[Any]:
            body = {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": offsets[url],
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            }
            return self._checked("init_weights_update_group", url, body)

        await self._each_worker("init_weights_update_group", call)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """Every worker leaves `group_name`."""
        body = {"group_name": group_name}
        await self._each_worker(
            "destroy_weights_update_group",
            lambda u: self._checked("destroy_weights_update_group", u, body),
        )

    async def update_weights_from_distributed_bucket(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        *,
        weight_version: int | None = None,
        flush_cache: bool = False,
    ) -> None:
        """One bucket of a distributed refit inside an open session (`begin_weight_update`); the
        trainer broadcasts the bucket's tensors, in order, while this call waits."""
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        await self._each_worker(
            "update_weights_from_distributed",
            lambda u: self._checked("update_weights_from_distributed", u, body),
        )

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: int | None = None,
    ) -> int:
        """A whole distributed refit in one bucket (begin → receive → end); the trainer
        broadcasts while this call waits. The trainer's `WeightSync` drives buckets itself."""

        async def call(url: str, version: str | None) -> Any:
            body: dict[str, Any] = {
                "names": names,
                "dtypes": dtypes,
                "shapes": shapes,
                "group_name": group_name,
                "flush_cache": True,
            }
            if version is not None:
                body["weight_version"] = version
            return await self._checked("update_weights_from_distributed", url, body)

        return await self._refit_session("update_weights_from_distributed", weight_version, [call])

    # ---- health, close -----------------------------------------------------------------------
    async def health(self) -> bool:
        """GET /health answered 200 (one try, no retries); a malformed URL is `InvalidRequest`."""
        session = await self._get_session()
        try:
            async with session.get(f"{self.base_url}/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return resp.status == 200
        except aiohttp.InvalidURL as exc:  # deterministic: waiting for it cannot help
            raise InvalidRequest(f"GET {self.base_url}/health: not a valid URL ({exc})") from exc
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def close(self) -> None:
        """Cancel pending abort re-sends; close the HTTP session."""
        for task in list(self._resends):
            task.cancel()
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None


def serialize_named_tensors(named: dict[str, Any]) -> str:
    """base64 of `[(name, tensor), ...]` — SGLang's `MultiprocessingSerializer` format.

    All-CUDA: `ForkingPickler` (CUDA IPC handles, nothing copied) with SGLang's reduction patch
    (device uuid instead of index, so a receiver under another `CUDA_VISIBLE_DEVICES` finds the
    GPU). Otherwise the tensors are pickled by value (CPU; `verst serve` only). Mixing is refused.
    """
    items = [(n, t.detach()) for n, t in named.items()]
    cuda = [getattr(t, "is_cuda", False) for _, t in items]
    if items and all(cuda):
        import io

        from torch.multiprocessing.reductions import ForkingPickler

        from verst.rollout.engines.cuda_ipc import patch_sender

        patch_sender()
        buf = io.BytesIO()
        ForkingPickler(buf).dump(items)
        return base64.b64encode(buf.getvalue()).decode()
    if any(cuda):
        raise InvalidRequest(
            "update_weights_from_tensors: tensors must be all on CUDA or all on CPU, not mixed"
        )
    return base64.b64encode(pickle.dumps([(n, t.contiguous()) for n, t in items])).decode()


def error_message(data: Any) -> Any:
    """The message of an SGLang error body: `{"error": {"message"}}`, `{"error": str}`, or an
    `ErrorResponse` (`{"object": "error", "message", "type", "code"}`)."""
    if not isinstance(data, dict):
        return data
    err = data.get("error")
    if isinstance(err, dict):
        return err.get("message", err)
    if err is not None:
        return err
    if "message" in data:
        return data["message"]
    return data


class _Tracked:
    """Registers rids as in flight for the duration of a `with` block."""

    def __init__(self, inflight: dict[str, int], rids: list[str]) -> None:
        self.inflight, self.rids = inflight, rids

    def __enter__(self) -> None:
        for r in self.rids:
            self.inflight[r] = self.inflight.get(r, 0) + 1

    def __exit__(self, *exc: object) -> None:
        for r in self.rids:
            left = self.inflight.get(r, 1) - 1
            if left > 0:
                self.inflight[r] = left
            else:
                self.inflight.pop(r, None)


def _nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


def _tags(tags: list[str] | None) -> list[str] | None:
    if tags is None:
        return None
    unknown = sorted(set(tags) - set(ALL_MEMORY_TAGS))
    if unknown:
        raise InvalidRequest(f"unknown memory tags {unknown}; valid: {list(ALL_MEMORY_TAGS)}")
    return list(tags)


_RANK_SUFFIX = re.compile(r"@\d+$")


def _worker_urls(data: Any) -> list[str] | None:
    """Worker URLs from a router's listing; dp-aware `http://h:p@rank` URLs name one server."""
    raw: list[Any] | None = None
    if isinstance(data, dict) and isinstance(data.get("urls"), list):
        raw = data["urls"]
    elif isinstance(data, dict) and isinstance(data.get("workers"), list):
        raw = [w.get("url") if isinstance(w, dict) else w for w in data["workers"]]
    elif isinstance(data, list):  # a bare list of workers
        raw = [w.get("url") if isinstance(w, dict) else w for w in data]
    if raw is None or not all(isinstance(u, str) for u in raw):
        return None
    urls: list[str] = []
    for u in raw:
        url = _RANK_SUFFIX.sub("", u.rstrip("/")).rstrip("/")
        if url not in urls:
            urls.append(url)
    return urls


def _version(info: Any, url: str) -> int:
    """`weight_version` from /model_info; a fresh SGLang server's `"default"` is version 0."""
    try:
        raw = info["weight_version"]
        return 0 if raw in (None, "", "default") else int(raw)
    except (TypeError, KeyError, ValueError):
        raise EngineError(f"{url}/model_info has no integer weight_version: {str(info)[:200]}") from None
