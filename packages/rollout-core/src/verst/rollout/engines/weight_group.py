"""A standalone process group for distributed weight refit (trainer rank 0 → engines).

Like SGLang's / slime's `init_custom_process_group`, the group never touches torch.distributed's
default group: it is built directly from a `TCPStore` (hosted by rank 0, the trainer) wrapped in
a `PrefixStore(group_name)`, and a `ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (CUDA) backend
object. Nothing is registered in torch.distributed's world, so it cannot collide with FSDP's
default group in the trainer, and the server needs no `init_process_group` at all. Collectives
are called on the backend object itself (`broadcast`), not through `torch.distributed.broadcast`.

NCCL is written against the same calls but unverified without a GPU; gloo is tested on CPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from verst.rollout.engines._common import InvalidRequest

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
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        self.pg.broadcast([tensor], opts).wait()
        if self.backend == "nccl":
            import torch

            torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        """Release the backend (best effort)."""
        shutdown = getattr(self.pg, "shutdown", None)
        if callable(shutdown):
            with contextlib.suppress(Exception):  # closing is best effort
                shutdown()
        self.pg = None
        self.store = None


def join_weight_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    *,
    timeout_s: float = 120.0,
) -> WeightGroup:
    """Join (rank 0: host) the group; blocks until all `world_size` members have joined.

    Rank 0 hosts the TCPStore at `master_address:master_port`; the others connect to it.
    """
    import torch
    import torch.distributed as dist

    if backend not in ("gloo", "nccl"):
        raise InvalidRequest(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise InvalidRequest(f"rank {rank} is outside the group of world_size {world_size}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise InvalidRequest("backend 'nccl' needs CUDA; use 'gloo' on CPU")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_address,
        int(master_port),
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,
    )
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        device = "cpu"
    else:  # pragma: no cover - needs a GPU
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        device = f"cuda:{torch.cuda.current_device()}"
    group = WeightGroup(group_name, rank, world_size, backend, device, pg, store)
    # a first collective makes every member wait for the others (NCCL connects lazily)
    probe = torch.zeros(1, device=device)
    group.broadcast(probe, src=0)
    return group


class DistributedRefit:
    """The engine side of `/init_weights_update_group` + `/update_weights_from_distributed`.

    Holds the groups this server joined (by name). Receiving runs in a worker thread so the
    event loop stays responsive; the received tensors are applied through the engine's
    `update_weights_from_tensors` (between decode steps, version-checked like any refit).
    """

    def __init__(self) -> None:
        self.groups: dict[str, WeightGroup] = {}
        """Joined groups by name."""

    async def init_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
        *,
        timeout_s: float = 120.0,
    ) -> None:
        """Join `group_name` as rank `rank_offset` (blocking rendezvous in a thread)."""
        import asyncio

        if group_name in self.groups:
            raise InvalidRequest(f"already in weight update group {group_name!r}; pick a new group_name")
        group = await asyncio.to_thread(
            join_weight_group,
            master_address,
            master_port,
            rank_offset,
            world_size,
            group_name,
            backend,
            timeout_s=timeout_s,
        )
        self.groups[group_name] = group

    def receive(
        self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]
    ) -> dict[str, Any]:
        """Receive each tensor by `broadcast(src=0)` into a fresh buffer (blocking)."""
        import torch

        group = self.groups.get(group_name)
        if group is None:
            raise InvalidRequest(
                f"no weight update group {group_name!r}; call /init_weights_update_group first "
                f"(joined: {sorted(self.groups)})"
            )
        if not (len(names) == len(dtypes) == len(shapes)):
            raise InvalidRequest(
                f"names, dtypes and shapes must have the same length, got {len(names)}, {len(dtypes)}, {len(shapes)}"
            )
        kinds = [torch_dtype(d) for d in dtypes]
        out: dict[str, Any] = {}
        for name, dtype, shape in zip(names, kinds, shapes, strict=True):
            buf = torch.empty([int(s) for s in shape], dtype=dtype, device=group.device)
            group.broadcast(buf, src=0)
            out[name] = buf
        return out

    async def update(
        self,
        engine: Any,
        group_name: str,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        weight_version: int | None = None,
    ) -> int:
        """Receive the broadcast, then apply it to `engine`; returns the engine's new version."""
        import asyncio

        named = await asyncio.to_thread(self.receive, group_name, names, dtypes, shapes)
        return await engine.update_weights_from_tensors(named, weight_version)

    def close(self) -> None:
        """Leave every group."""
        for group in self.groups.values():
            group.close()
        self.groups.clear()
