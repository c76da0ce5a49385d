"""A process group for distributed weight refit (trainer rank 0 → engine ranks), built the way
SGLang 0.5.23 builds its side, so the two meet.

SGLang's server joins with `init_custom_process_group` (`sglang/srt/utils/common.py`):
`torch.distributed.rendezvous("tcp://addr:port", rank, world_size)` (rank 0 hosts the TCPStore),
a `PrefixStore(group_name, store)`, then torch's own `_new_process_group_helper(world_size,
rank, [], backend, store, group_name=group_name, ...)` (which adds its own `f"{group_name}/"` and
per-device prefixes), and it registers the group's ranks as the identity map. `join_weight_group`
does exactly that (the wheel's function cannot be imported without sglang's dependencies, so it
is replicated here with the same torch calls and prefixes). Collectives are
`torch.distributed.broadcast(tensor, src=0, group=pg)`, like SGLang's receiver; no extra probe
collective is sent (the server would never match it). The default torch.distributed group is
never touched, so FSDP's is unaffected and `verst serve` needs none.

Ranks: the trainer is rank 0; an engine with `G` GPUs (tensor parallel included) takes ranks
`rank_offset .. rank_offset + G - 1` (server rank = `rank_offset + tp_rank`), so
`world_size = 1 + sum(G)` and each engine gets its own `rank_offset`.

NCCL needs one rank per GPU: a trainer and an engine sharing one GPU cannot be in one NCCL group
(refused with a clear error by the trainer; use disk or tensor refit there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from verst.rollout.engine import WeightBucket, WeightGroupSpec
from verst.rollout.engines.common.errors import InvalidRequest

DTYPES = ("float32", "float16", "bfloat16", "float64")
"""dtype names accepted on the wire (torch's, without the `torch.` prefix)."""


def torch_dtype(name: str) -> Any:
    """`"bfloat16"` or `"torch.bfloat16"` → `torch.bfloat16`; an unknown name is an InvalidRequest."""
    import torch

    short = name.removeprefix("torch.")
    if short not in DTYPES:
        raise InvalidRequest(f"unsupported dtype {name!r}; expected one of {DTYPES}")
    return getattr(torch, short)


def dtype_name(dtype: Any) -> str:
    """`torch.bfloat16` → `"bfloat16"` (the wire form)."""
    return str(dtype).removeprefix("torch.")


@dataclass
class WeightGroup:
    """One member of a weight-refit group: broadcast from rank 0 to everyone."""

    name: str
    """The group name (also the store prefix)."""
    rank: int
    """This member's rank (0 = the trainer)."""
    world_size: int
    """Members in total (the trainer plus every engine rank)."""
    backend: str
    """`gloo` or `nccl`."""
    device: str
    """Where the tensors that go through the group live (`cpu` for gloo, `cuda` for nccl)."""
    pg: Any
    """The torch backend object (`ProcessGroupGloo` / `ProcessGroupNCCL`)."""
    store: Any
    """The TCPStore (kept alive for the group's lifetime)."""

    def broadcast(self, tensor: Any, src: int = 0) -> None:
        """In-place broadcast of `tensor` from rank `src` (blocks until done)."""
        import torch
        import torch.distributed as dist

        dist.broadcast(tensor, src=src, group=self.pg, async_op=True).wait()
        if self.backend == "nccl":  # pragma: no cover - needs a GPU
            torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        """Destroy the group (best effort); the name can then be used again."""
        import torch.distributed as dist

        if self.pg is not None:
            with contextlib.suppress(Exception):  # closing is best effort
                dist.destroy_process_group(self.pg)
        self.pg = None
        self.store = None


def init_custom_process_group(
    *,
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta,
    device_id: Any = None,
) -> tuple[Any, Any]:
    """SGLang's `init_custom_process_group` (0.5.23), same torch calls in the same order.

    Returns `(process_group, store)`; the group is not the default group.
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
        device_id=device_id,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg, store


def join_weight_group(group: WeightGroupSpec, *, timeout_s: float = 120.0) -> WeightGroup:
    """Join `group` as rank `group.rank_offset` (rank 0 hosts the store at
    `master_address:master_port`).

    Returns once this member's side is built; the rendezvous completes when all `world_size`
    members have joined (NCCL connects lazily, at the first broadcast).
    """
    import torch

    backend, rank, world_size = group.backend, group.rank_offset, group.world_size
    if backend not in ("gloo", "nccl"):
        raise InvalidRequest(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise InvalidRequest(f"rank {rank} is outside the group of world_size {world_size}")
    if not group.group_name:
        raise InvalidRequest("group_name must not be empty")
    if backend == "nccl" and not torch.cuda.is_available():
        raise InvalidRequest("backend 'nccl' needs CUDA; use 'gloo' on CPU")
    address = group.master_address
    host = f"[{address}]" if ":" in address else address
    pg, store = init_custom_process_group(
        backend=backend,
        init_method=f"tcp://{host}:{int(group.master_port)}",
        world_size=world_size,
        rank=rank,
        group_name=group.group_name,
        timeout=timedelta(seconds=timeout_s),
    )
    device = "cpu" if backend == "gloo" else f"cuda:{torch.cuda.current_device()}"
    return WeightGroup(group.group_name, rank, world_size, backend, device, pg, store)


def engine_rank_offsets(gpus_per_engine: Iterable[int]) -> tuple[list[int], int]:
    """Rank offsets of each engine and the group's world size (trainer = rank 0).

    `[2, 1, 4]` → `([1, 3, 4], 8)`: engine i takes ranks `offset_i .. offset_i + G_i - 1`.
    """
    sizes = [int(g) for g in gpus_per_engine]
    if any(g < 1 for g in sizes):
        raise InvalidRequest(f"every engine needs at least one GPU (rank), got {sizes}")
    offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
    return offsets, 1 + sum(sizes)


def bucket_of(state: dict[str, Any], names: list[str], group_name: str) -> WeightBucket:
    """The `WeightBucket` describing `state[name]` for each of `names` (in that order)."""
    tensors = [state[n] for n in names]
    return WeightBucket(
        names=list(names),
        dtypes=[dtype_name(t.dtype) for t in tensors],
        shapes=[list(t.shape) for t in tensors],
        group_name=group_name,
    )


def buckets(sizes: Iterable[tuple[str, int]], max_bytes: int) -> Iterator[list[str]]:
    """Group names into consecutive buckets of at most `max_bytes` (a larger tensor goes alone)."""
    if max_bytes < 1:
        raise InvalidRequest(f"bucket size must be positive, got {max_bytes} bytes")
    bucket: list[str] = []
    used = 0
    for name, nbytes in sizes:
        if bucket and used + nbytes > max_bytes:
            yield bucket
            bucket, used = [], 0
        bucket.append(name)
        used += nbytes
    if bucket:
        yield bucket


class DistributedRefit:
    """The engine side of `/init_weights_update_group` + `/update_weights_from_distributed`.

    Holds the groups this server joined (by name). Receiving runs in a worker thread so the
    event loop stays responsive; the received tensors are applied through the engine's
    `update_weights_from_tensors` (between decode steps, version-checked like any refit).
    """

    def __init__(self) -> None:
        self.groups: dict[str, WeightGroup] = {}
        """Joined groups by name."""

    async def init_group(self, group: WeightGroupSpec, *, timeout_s: float = 120.0) -> None:
        """Join `group` as rank `group.rank_offset` (blocking rendezvous in a thread)."""
        import asyncio

        if group.group_name in self.groups:
            raise InvalidRequest(
                f"already in weight update group {group.group_name!r}; pick a new group_name"
            )
        member = await asyncio.to_thread(join_weight_group, group, timeout_s=timeout_s)
        self.groups[group.group_name] = member

    def receive(self, bucket: WeightBucket) -> dict[str, Any]:
        """Receive each tensor by `broadcast(src=0)` into a fresh buffer (blocking)."""
        import torch

        names, dtypes, shapes = bucket.names, bucket.dtypes, bucket.shapes
        group = self.groups.get(bucket.group_name)
        if group is None:
            raise InvalidRequest(
                f"no weight update group {bucket.group_name!r}; call /init_weights_update_group first "
                f"(joined: {sorted(self.groups)})"
            )
        if not (len(names) == len(dtypes) == len(shapes)):
            raise InvalidRequest(
                f"names, dtypes and shapes must have the same length, got {len(names)}, {len(dtypes)}, {len(shapes)}"
            )
        kinds = [torch_dtype(d) for d in dtypes]
        import torch.distributed as dist

        out: dict[str, Any] = {}
        handles = []
        for name, dtype, shape in zip(names, kinds, shapes, strict=True):
            buf = torch.empty([int(s) for s in shape], dtype=dtype, device=group.device)
            handles.append(dist.broadcast(buf, src=0, group=group.pg, async_op=True))
            out[name] = buf
        for handle in handles:  # like SGLang's receiver: post every broadcast, then wait
            handle.wait()
        if group.backend == "nccl":  # pragma: no cover - needs a GPU
            torch.cuda.current_stream().synchronize()
        return out

    def destroy(self, group_name: str) -> None:
        """Leave `group_name` (SGLang's /destroy_weights_update_group)."""
        group = self.groups.pop(group_name, None)
        if group is None:
            raise InvalidRequest(
                f"no weight update group {group_name!r} to destroy (joined: {sorted(self.groups)})"
            )
        group.close()

    def close(self) -> None:
        """Leave every group."""
        for group in self.groups.values():
            group.close()
        self.groups.clear()
