"""SGLang's weight-update API on the client side (mixed into `SGLangClient`), SGLang 0.5.23.

Refit: pause → flush → `/begin_weight_update` → update in buckets bounded by bytes
(`flush_cache` only with the last) → `/end_weight_update` → continue; the version the server
reports afterwards is checked. From disk: pause → flush → `/update_weights_from_disk` → check →
continue. Tensors: CUDA tensors travel as CUDA IPC handles (SGLang's device-uuid reduction patch
applied on the sender, one payload per tensor-parallel rank); CPU tensors are pickled by value,
one bucket per body (a real SGLang server's safe unpickler accepts only the CUDA form; `verst
serve` takes both). Distributed: the workers join the trainer's group (`init_weights_update_group`)
and receive broadcast buckets. Memory: release/resume occupation for colocated training.
"""

from __future__ import annotations

import asyncio
import base64
import pickle
from collections.abc import Awaitable, Callable
from dataclasses import asdict, replace
from typing import Any

from verst.rollout.engine import EngineError, EngineTimeout, WeightBucket, WeightGroupSpec
from verst.rollout.engines.common.errors import InvalidRequest
from verst.rollout.engines.common.wire import model_info_version

DEFAULT_BUCKET_BYTES = 512 << 20
"""Refit bucket bound: at most this many tensor bytes per update call (one JSON body)."""
ALL_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""SGLang's memory-occupation tags (`sglang.srt.constants.GPU_MEMORY_ALL_TYPES`)."""


class SGLangWeightsMixin:
    """Weight versions, refits (disk, tensors, distributed) and memory occupation over HTTP."""

    _call: Callable[..., Awaitable[Any]]
    _each_worker: Callable[..., Awaitable[list[Any]]]
    workers: Callable[[], Awaitable[list[str]]]
    pause_mode: str
    tp_size: int
    bucket_bytes: int
    _held: bool

    async def get_weight_version(self) -> int:
        """The weight version of the (first) worker, from /model_info (`"default"` = 0)."""
        urls = await self.workers()
        return await self._worker_version(urls[0])

    async def _worker_version(self, url: str, expected: int | None = None, what: str = "refit") -> int:
        """The weight version worker `url` reports (/model_info); an `EngineError` naming `what`
        when it is not `expected` (None: any)."""
        got = model_info_version(await self._call("GET", "/model_info", base=url), url)
        if expected is not None and got != expected:
            raise EngineError(f"{what} on {url}: server reports weight version {got}, expected {expected}")
        return got

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
            first_stall(failed)
            detail = "; ".join(f"{u}: {e}" for u, e in failed)
            cls = InvalidRequest if all(isinstance(e, InvalidRequest) for _, e in failed) else EngineError
            raise cls(
                f"begin_weight_update failed on {len(failed)} of {len(urls)} workers ({detail}); "
                f"the session was rolled back on the other {len(begun)}"
            )

    async def _roll_back(self, url: str) -> None:
        """Close a session opened on `url` and continue it (after another worker failed)."""
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
                    await self._worker_version(url, weight_version)
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
        await self.begin_weight_update()
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
                await self._worker_version(url, target, "update_weights_from_disk")
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
        here), one payload per tensor-parallel rank; CPU tensors are pickled by value. float32
        tensors are cast to the worker's 16-bit `dtype` first when its /server_info names one
        (`server_weight_dtype`).
        """
        from verst.rollout.engines.common.weight_group import buckets

        sizes = [(n, _nbytes(t)) for n, t in named_tensors.items()]
        infos = await self._worker_infos()
        calls = []
        for names in buckets(sizes, self.bucket_bytes):
            part = {n: named_tensors[n] for n in names}

            async def call(url: str, version: str | None, part: dict[str, Any] = part) -> Any:
                wire = cast_for_wire(part, server_weight_dtype(infos[url]))  # alive until answered
                tp = self._tp_of(infos[url])
                body: dict[str, Any] = {
                    "serialized_named_tensors": [serialize_named_tensors(wire) for _ in range(tp)],
                    "flush_cache": version is not None,
                }
                if version is not None:
                    body["weight_version"] = version
                return await self._checked("update_weights_from_tensor", url, body)

            calls.append(call)
        return await self._refit_session("update_weights_from_tensor", weight_version, calls)

    async def _worker_infos(self) -> dict[str, dict[str, Any]]:
        """Each worker's /server_info (an empty dict when the body is not an object)."""
        urls = await self.workers()

        async def one(url: str) -> dict[str, Any]:
            info = await self._call("GET", "/server_info", base=url)
            return info if isinstance(info, dict) else {}

        return dict(zip(urls, await asyncio.gather(*(one(u) for u in urls)), strict=True))

    def _tp_of(self, info: dict[str, Any]) -> int:
        tp = info.get("tp_size")
        return int(tp) if isinstance(tp, int) and tp > 0 else self.tp_size

    async def _worker_gpus(self) -> dict[str, int]:
        """GPUs (= ranks in a weight group) per worker: `tp_size` from /server_info, else ours."""
        return {url: self._tp_of(info) for url, info in (await self._worker_infos()).items()}

    async def reported_weight_dtype(self) -> str | None:
        """The workers' common 16-bit weight dtype (`server_weight_dtype` of each /server_info),
        None when they differ, one is not known to be 16-bit, or /server_info is not served."""
        try:
            infos = await self._worker_infos()
        except (InvalidRequest, EngineError):  # not known: the trainer sends what it trained
            return None
        dtypes = {server_weight_dtype(info) for info in infos.values()}
        return dtypes.pop() if len(dtypes) == 1 else None

    async def replica_states(self) -> list[tuple[str, Any, int]]:
        """Per worker: its URL, its `startup_time` (/server_info: a restart changes it) and its
        weight version (`verst.rollout.engines.common.replicas`)."""
        infos = await self._worker_infos()

        async def one(url: str) -> tuple[str, Any, int]:
            return url, infos[url].get("startup_time"), await self._worker_version(url)

        return list(await asyncio.gather(*(one(u) for u in infos)))

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
            await self._call("POST", "/release_memory_occupation", {"tags": memory_tags(tags)}, base=url)

        self._held = True
        await self._each_worker("release_memory_occupation", one)

    async def resume_memory_occupation(
        self, tags: list[str] | None = None, *, continue_generation: bool = True
    ) -> None:
        """Take back `tags` (None = all) on every worker; then continue generation unless told not to
        (resume `weights`, refit, then resume the rest). Until generation continues here, refits
        leave it paused (the KV cache may still be released)."""

        async def one(url: str) -> None:
            await self._call("POST", "/resume_memory_occupation", {"tags": memory_tags(tags)}, base=url)
            if continue_generation:
                await self._call("POST", "/continue_generation", {}, base=url)

        await self._each_worker("resume_memory_occupation", one)
        if continue_generation:
            self._held = False

    async def init_weights_update_group(self, group: WeightGroupSpec) -> None:
        """Every worker joins the trainer's group: worker i takes ranks from `group.rank_offset` plus
        the GPUs of the workers before it (SGLang: server rank = rank_offset + tp_rank)."""
        gpus = await self._worker_gpus()
        offsets, offset = {}, group.rank_offset
        for url, g in gpus.items():
            offsets[url], offset = offset, offset + g
        if offset > group.world_size:
            raise InvalidRequest(
                f"init_weights_update_group: the workers need ranks {group.rank_offset}..{offset - 1} "
                f"but world_size is {group.world_size}"
            )

        def call(url: str) -> Awaitable[Any]:
            body = asdict(replace(group, rank_offset=offsets[url]))
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
        self, bucket: WeightBucket, *, weight_version: int | None = None, flush_cache: bool = False
    ) -> None:
        """One bucket of a distributed refit inside an open session (`begin_weight_update`); the
        trainer broadcasts the bucket's tensors, in order, while this call waits."""
        version = None if weight_version is None else str(weight_version)
        body = _distributed_body(bucket, flush_cache, version)
        await self._each_worker(
            "update_weights_from_distributed",
            lambda u: self._checked("update_weights_from_distributed", u, body),
        )

    async def update_weights_from_distributed(
        self, bucket: WeightBucket, weight_version: int | None = None
    ) -> int:
        """A whole distributed refit in one bucket (begin → receive → end); the trainer
        broadcasts while this call waits. The trainer's `WeightSync` drives buckets itself."""

        async def call(url: str, version: str | None) -> Any:
            body = _distributed_body(bucket, True, version)
            return await self._checked("update_weights_from_distributed", url, body)

        return await self._refit_session("update_weights_from_distributed", weight_version, [call])


def first_stall(failed: list[tuple[str, BaseException]]) -> None:
    """Raise the first `EngineTimeout` of the workers' failures: its one line names the worker,
    the route and the bound (an aggregate message would bury it)."""
    for _url, error in failed:
        if isinstance(error, EngineTimeout):
            raise error


def _distributed_body(bucket: WeightBucket, flush_cache: bool, weight_version: str | None) -> dict[str, Any]:
    """SGLang's `/update_weights_from_distributed` body: names, dtypes, shapes, group_name,
    flush_cache, and weight_version when one is sent."""
    body: dict[str, Any] = {**asdict(bucket), "flush_cache": flush_cache}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


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

        from verst.rollout.engines.common.cuda_ipc import patch_sender

        patch_sender()
        buf = io.BytesIO()
        ForkingPickler(buf).dump(items)
        return base64.b64encode(buf.getvalue()).decode()
    if any(cuda):
        raise InvalidRequest(
            "update_weights_from_tensors: tensors must be all on CUDA or all on CPU, not mixed"
        )
    return base64.b64encode(pickle.dumps([(n, t.contiguous()) for n, t in items])).decode()


NARROW_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16"}
"""SGLang's `--dtype` values that name a 16-bit weight dtype (`auto`, `float`, `float32` do not)."""


def server_weight_dtype(info: dict[str, Any]) -> str | None:
    """The 16-bit dtype a server holds its weights in, from its /server_info (`dtype`, SGLang's
    `--dtype`; `verst serve` reports the resolved one), or None: not 16-bit, not known
    (`auto`), or quantized (a quantizer may use the precision it is given)."""
    if info.get("quantization") is not None:
        return None
    dtype = info.get("dtype")
    return NARROW_DTYPES.get(dtype) if isinstance(dtype, str) else None


def cast_for_wire(named: dict[str, Any], dtype: str | None) -> dict[str, Any]:
    """float32 tensors cast to `dtype` (the server would cast them on load anyway; half the
    bytes on the wire), the others unchanged; `named` itself when `dtype` is None."""
    if dtype is None:
        return named
    import torch

    target = getattr(torch, dtype)
    return {n: t.to(target) if t.dtype == torch.float32 else t for n, t in named.items()}


def _nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())


def memory_tags(tags: list[str] | None) -> list[str] | None:
    if tags is None:
        return None
    unknown = sorted(set(tags) - set(ALL_MEMORY_TAGS))
    if unknown:
        raise InvalidRequest(f"unknown memory tags {unknown}; valid: {list(ALL_MEMORY_TAGS)}")
    return list(tags)
