"""CUDA IPC handles that name the GPU by uuid: SGLang's torch-reduction patch, in our own code.

torch pickles a CUDA tensor for another process as an IPC handle plus the *device index* of the
sender (`reduce_tensor`'s 7th rebuild argument). Under Ray each process sees its own
`CUDA_VISIBLE_DEVICES`, so index 0 in the trainer may be index 3 in the SGLang server, and the
receiver would open the handle on the wrong GPU. SGLang (`sglang/srt/utils/patch_torch.py`,
`monkey_patch_torch_reductions`) replaces the index with the device's uuid on the sender and maps
it back on the receiver; its server applies the receiving half before it deserializes
`/update_weights_from_tensor`. The sender must apply the sending half (`patch_sender`, used by
the SGLang client); `patch_receiver` is the receiving half (`verst serve` on CUDA). Both are
idempotent and process-wide by nature (they change how torch pickles CUDA tensors).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

DEVICE_ARG = 6
"""Index of the device argument in `rebuild_cuda_tensor`'s arguments (stable across torch 2.x)."""


def replace_arg(args: tuple[Any, ...], index: int, fn: Callable[[Any], Any]) -> tuple[Any, ...]:
    """`args` with `args[index]` replaced by `fn(args[index])`."""
    return (*args[:index], fn(args[index]), *args[index + 1 :])


def device_uuid(index: int) -> str:
    """The uuid string of CUDA device `index` (as this process numbers it)."""
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def device_index(device: int | str) -> int:
    """A device index, or the index of the local device whose uuid is `device`."""
    import torch

    if isinstance(device, int):
        return device
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == device:
            return i
    raise RuntimeError(
        f"CUDA IPC: no visible GPU has uuid {device}; sender and receiver must share the GPU "
        f"(same host; check CUDA_VISIBLE_DEVICES)"
    )


def _rebuild_cuda_tensor(*args: Any) -> Any:
    """torch's `rebuild_cuda_tensor`, accepting a device uuid (the receiving half)."""
    from torch.multiprocessing import reductions

    original = reductions._verst_rebuild_cuda_tensor_original
    return original(*replace_arg(args, DEVICE_ARG, device_index))


def patch_sender() -> None:
    """Pickle CUDA tensors with the device uuid instead of the index (the sending half).

    Only `reduce_tensor` changes: the pickle still names torch's own `rebuild_cuda_tensor`, which
    SGLang's safe unpickler allows and its patched receiver resolves. Idempotent.
    """
    from torch.multiprocessing import reductions

    if getattr(reductions, "_verst_sender_patched", False):
        return
    original_reduce = reductions.reduce_tensor
    rebuilds = {reductions.rebuild_cuda_tensor, _rebuild_cuda_tensor}

    def reduce_tensor(*args: Any, **kwargs: Any) -> Any:
        fn, fn_args = original_reduce(*args, **kwargs)
        if fn in rebuilds and isinstance(fn_args[DEVICE_ARG], int):
            fn_args = replace_arg(fn_args, DEVICE_ARG, device_uuid)
        return fn, fn_args

    reductions.reduce_tensor = reduce_tensor
    reductions._verst_sender_patched = True
    reductions.init_reductions()


def patch_receiver() -> None:
    """Accept a device uuid where torch expects a device index when rebuilding a CUDA tensor
    (what SGLang's server does before it deserializes; `verst serve` on CUDA). Idempotent."""
    from torch.multiprocessing import reductions

    if hasattr(reductions, "_verst_rebuild_cuda_tensor_original"):
        return
    reductions._verst_rebuild_cuda_tensor_original = reductions.rebuild_cuda_tensor
    reductions.rebuild_cuda_tensor = _rebuild_cuda_tensor
