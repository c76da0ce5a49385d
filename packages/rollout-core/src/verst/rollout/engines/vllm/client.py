"""`VllmClient`: the `InferenceEngine` protocol over one vLLM server's HTTP API (vllm 0.32 / 0.33).

Generation is token-in / token-out (`POST /inference/v1/generate`, `verst.rollout.engines.vllm.
wire`): prompt ids in; output ids, their log-probs and per-span weight versions out
(`GenerateOutput.output_token_versions`). `generate_n` asks one prompt for `n` samples in one
request (vLLM fans it out; with a seed, sample i gets seed + i).

Aborts are exact: the client remembers every request in flight; `abort(prefix)` sends
`/abort_requests {"request_ids": ["generate-tokens-<rid>", ...]}` for the matching ones and
re-sends it for any still running a moment later (a request can reach the server after its
abort). vLLM's reply counts the ids it was sent, not what it aborted, so it proves nothing:
`abort_confirmed` waits for the requests themselves and returns how each one ended.
`abort(None)` is `/abort_requests {}` (everything the server runs).

Refit from disk: `/pause?mode=<pause_mode>` → `/collective_rpc reload_weights {weights_path}` →
`/update_weight_version` → `/reset_prefix_cache?reset_running_requests=true` (cached prefixes
were computed with the old weights; requests kept by a `keep` pause are re-prefilled with the
new ones) → `/resume`; the version `/weight_info` reports afterwards is checked. With
`pause_mode="keep"` in-flight requests survive the refit and their remaining tokens carry the
new version. NCCL weight transfer (GPU): `verst.rollout.engines.vllm.refit`. LoRA:
`verst.rollout.engines.vllm.lora`.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Literal, Unpack

from verst.rollout.engine import EngineCapabilities, EngineError, GenerateOutput, GenerateRequest
from verst.rollout.engines.common.aborts import AbortResends, InFlight
from verst.rollout.engines.common.http import CallKind, HttpOptions, HttpSettings
from verst.rollout.engines.vllm.checks import ServerFacts, check_server
from verst.rollout.engines.vllm.http import HttpCaller
from verst.rollout.engines.vllm.lora import VllmLoraMixin
from verst.rollout.engines.vllm.refit import VllmWeightTransferMixin
from verst.rollout.engines.vllm.wire import (
    GENERATE_PATH,
    engine_request_id,
    generate_json,
    parse_generate,
    parse_version,
)
from verst.rollout.errors import Problem

PauseMode = Literal["abort", "keep", "wait"]


class VllmClient(VllmLoraMixin, VllmWeightTransferMixin):
    """An async client of one vLLM server (started with the flags `checks` lists)."""

    def __init__(
        self,
        base_url: str,
        *,
        pause_mode: PauseMode = "keep",
        abort_resend_s: float = 0.5,
        capabilities: EngineCapabilities | None = None,
        **http: Unpack[HttpOptions],
    ) -> None:
        """`http`: the `HttpSettings` fields (`max_connections` should equal the rollout's
        concurrency; retries only for retryable failures); `pause_mode` is the `/pause` mode of a refit (keep: in-flight
        requests continue afterwards with the new weights; abort: they end with their partial
        output; wait: the refit waits for them); `abort_resend_s`: exact aborts are re-sent
        after this delay (then 2x and 4x) for requests still in flight."""
        self.http_settings = HttpSettings(**http)
        self.http = HttpCaller(base_url, self.http_settings)
        self.base_url = self.http.base_url
        self.pause_mode: PauseMode = pause_mode
        self.capabilities = capabilities or EngineCapabilities(weight_sync=("disk",), lora=True)
        """What this engine can do (the trainer asks this)."""
        self.facts: ServerFacts | None = None
        """What `check` learnt about the server."""
        self._inflight = InFlight()
        """rid → requests in flight with it."""
        self._waiters: dict[str, list[asyncio.Future[str]]] = {}
        """rid → futures resolved with the finish reason when its request ends."""
        self._resends = AbortResends(self._inflight, self._abort_exact, abort_resend_s)
        """Background re-sends of exact aborts (cancelled on close)."""
        self._tensor_adapter_dirs: dict[str, Any] = {}
        """LoRA adapters loaded from tensors: name → the folder written for it."""
        self._version = 0
        """The last weight version this client set or read (labels answers without spans)."""

    def __repr__(self) -> str:
        return f"VllmClient({self.base_url!r})"

    async def _call(self, method: str, path: str, body: Any = None, *, kind: CallKind | None = None) -> Any:
        """Bounded by the route's kind (or `kind`): `common.http.engine_bounds`."""
        return await self.http.call(method, path, body, kind=kind)

    # ---- checks ------------------------------------------------------------------------------
    async def check(
        self, key: str = "engine", *, lora: bool = False, nccl: bool = False, routed: bool = False
    ) -> list[Problem]:
        """The server's problems for this run (dev mode off, scale-out off, no LoRA, no routed
        experts, too old, unreachable...), all at once; remembers its facts."""
        problems, self.facts = await check_server(self.http, key, lora=lora, nccl=nccl, routed=routed)
        return problems

    # ---- generation --------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """One request, one sample."""
        return (await self._generate(request, 1))[0]

    async def generate_n(self, request: GenerateRequest, n: int) -> list[GenerateOutput]:
        """`n` samples of one prompt in one request (with a seed, sample i uses seed + i)."""
        return await self._generate(request, n)

    async def _generate(self, request: GenerateRequest, n: int) -> list[GenerateOutput]:
        rid = request.rid or uuid.uuid4().hex
        reason = "abort"
        with self._inflight.track([rid]):
            try:
                data = await self._call("POST", GENERATE_PATH, generate_json(request, rid, n=n))
                outs = parse_generate(data, request, self._version)
                reason = outs[0].finish_reason if outs else "abort"
            finally:
                self._settle(rid, reason)
        if len(outs) != n:
            raise EngineError(f"{GENERATE_PATH} returned {len(outs)} choices, expected {n}")
        return outs

    def _settle(self, rid: str, reason: str) -> None:
        for fut in self._waiters.pop(rid, []):
            if not fut.done():
                fut.set_result(reason)

    # ---- abort, pause ------------------------------------------------------------------------
    async def abort(self, rid_prefix: str | None = None) -> None:
        """Abort every in-flight request whose rid starts with `rid_prefix` (exactly, by vLLM's
        id), or everything the server runs when None."""
        if rid_prefix is None:
            await self._call("POST", "/abort_requests", {})
            return
        rids = self._inflight.matching(rid_prefix)
        await self._abort_exact(rids)
        self._resends.schedule(rids)

    async def abort_confirmed(self, rid_prefix: str, timeout_s: float = 30.0) -> dict[str, str]:
        """Abort like `abort`, then wait for each matching request to end; returns rid → its
        finish reason ("abort" when the abort took; "stop"/"length" when it ended first).
        A request still running after `timeout_s` is an `EngineError`."""
        loop = asyncio.get_running_loop()
        rids = self._inflight.matching(rid_prefix)
        futures = {}
        for rid in rids:
            futures[rid] = loop.create_future()
            self._waiters.setdefault(rid, []).append(futures[rid])
        await self.abort(rid_prefix)
        _done, pending = (
            await asyncio.wait(futures.values(), timeout=timeout_s) if futures else (set(), set())
        )
        if pending:
            left = [r for r, f in futures.items() if f in pending]
            raise EngineError(
                f"abort at {self.base_url}: {left} still running {timeout_s:.0f}s after the abort"
            )
        return {rid: fut.result() for rid, fut in futures.items()}

    async def _abort_exact(self, rids: list[str]) -> None:
        if rids:
            await self._call("POST", "/abort_requests", {"request_ids": [engine_request_id(r) for r in rids]})

    async def pause(self, mode: PauseMode | None = None) -> None:
        """`POST /pause?mode=...`: abort (in-flight requests end with their partial output), keep
        (they freeze and continue on `resume`) or wait (returns once they have finished)."""
        mode = mode or self.pause_mode
        await self._call("POST", f"/pause?mode={mode}", kind="generate" if mode == "wait" else None)

    async def resume(self) -> None:
        """`POST /resume`."""
        await self._call("POST", "/resume")

    async def is_paused(self) -> bool:
        """`GET /is_paused`."""
        data = await self._call("GET", "/is_paused")
        return bool(data.get("is_paused")) if isinstance(data, dict) else False

    # ---- weights -----------------------------------------------------------------------------
    async def get_weight_version(self) -> int:
        """`GET /weight_info` (a fresh server's "default" is 0)."""
        data = await self._call("GET", "/weight_info")
        self._version = parse_version(data.get("weight_version") if isinstance(data, dict) else None)
        return self._version

    async def _set_version(self, version: int) -> None:
        await self._call("POST", "/update_weight_version", {"new_version": str(version)})
        self._version = version

    async def _reset_prefix_cache(self) -> None:
        """Drop cached prefixes computed with the old weights (running requests are re-prefilled)."""
        data = await self._call("POST", "/reset_prefix_cache?reset_running_requests=true")
        if isinstance(data, dict) and data.get("success") is False:
            raise EngineError(f"reset_prefix_cache on {self.base_url} failed after a refit")

    async def _paused_refit(self, what: str, version: int | None, body: Any) -> int:
        """pause → `body()` → set the version → reset the prefix cache → resume → check."""
        target = (await self.get_weight_version()) + 1 if version is None else int(version)
        await self.pause()
        try:
            await body()
            await self._set_version(target)
            await self._reset_prefix_cache()
        finally:
            await self.resume()
        got = await self.get_weight_version()
        if got != target:
            raise EngineError(
                f"{what} on {self.base_url}: server reports weight version {got}, expected {target}"
            )
        return got

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> int:
        """Reload the weights from a checkpoint directory the server can read (`collective_rpc
        reload_weights`, dev mode); returns the new version."""

        async def reload() -> None:
            body = {"method": "reload_weights", "kwargs": {"weights_path": str(model_path)}}
            await self._call("POST", "/collective_rpc", body)  # engine.refit_timeout_s

        return await self._paused_refit("reload_weights", weight_version, reload)

    async def update_weights_from_tensors(
        self, named_tensors: dict[str, Any], weight_version: int | None = None
    ) -> int:
        """vLLM takes no tensors over HTTP (its `/update_weights` needs a transfer engine):
        writes them as a safetensors checkpoint next to nothing else and reloads it."""
        import tempfile

        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(prefix="verst-vllm-refit-") as tmp:
            tensors = {n: t.detach().cpu().contiguous() for n, t in named_tensors.items()}
            await asyncio.to_thread(save_file, tensors, f"{tmp}/model.safetensors")
            return await self.update_weights_from_disk(tmp, weight_version)

    # ---- health, close -----------------------------------------------------------------------
    async def health(self) -> bool:
        """`GET /health` answered 200 (one try, no retries)."""
        return await self.http.healthy("/health")

    async def close(self) -> None:
        """Cancel pending abort re-sends; close the HTTP session."""
        import shutil

        self._resends.cancel()
        for folder in self._tensor_adapter_dirs.values():
            shutil.rmtree(folder, ignore_errors=True)
        self._tensor_adapter_dirs.clear()
        await self.http.close()
