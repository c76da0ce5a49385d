"""Backend selection: which implementation (Triton or torch) runs for a given tensor.

Whether Triton can run is computed once per process (`triton_available`, cached). Triton kernels
run on CUDA tensors when a CUDA driver is active, and on CPU tensors only in Triton's interpreter
mode (`TRITON_INTERPRET=1`, which Triton itself reads when it is first imported; this module never
reads the environment).
"""

from __future__ import annotations

import functools
from typing import Literal, get_args

import torch

Backend = Literal["triton", "torch"]
"""Implementation choice for every public kernel function."""

BACKENDS: tuple[str, ...] = get_args(Backend)


@functools.cache
def _triton_module_state() -> tuple[bool, bool, str]:
    """(importable, interpreter mode on, reason when not importable) — computed once."""
    try:
        import triton  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name != "triton":
            raise
        return False, False, "triton is not installed (`uv sync` installs it on Linux)"
    from triton import knobs

    return True, bool(knobs.runtime.interpret), ""


@functools.cache
def triton_available() -> bool:
    """True when Triton kernels can run in this process: CUDA with Triton, or interpreter mode."""
    importable, interpret, _ = _triton_module_state()
    return importable and (interpret or torch.cuda.is_available())


def _triton_can_run_on(device: torch.device) -> tuple[bool, str]:
    importable, interpret, reason = _triton_module_state()
    if not importable:
        return False, reason
    if device.type == "cuda":
        if interpret:
            return False, "Triton is in interpreter mode (TRITON_INTERPRET=1), which runs on CPU tensors"
        return True, ""
    if device.type == "cpu":
        if interpret:
            return True, ""
        return False, (
            "Triton compiles for GPUs only; on CPU tensors it runs only in interpreter mode, "
            "which needs TRITON_INTERPRET=1 set before triton is first imported"
        )
    return False, f"Triton kernels support CUDA (and interpreted CPU) tensors, not {device.type!r}"


def resolve_backend(device: torch.device, backend: Backend | None) -> Backend:
    """Pick the implementation: CUDA → Triton when it can run, else torch; `backend=` forces one.

    Raises ValueError for an unknown backend name and RuntimeError when Triton is forced where it
    cannot run.
    """
    if backend is None:
        return "triton" if device.type == "cuda" and _triton_can_run_on(device)[0] else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid choices: {', '.join(BACKENDS)} or None (auto)")
    if backend == "triton":
        ok, why = _triton_can_run_on(device)
        if not ok:
            raise RuntimeError(
                f"backend='triton' was forced for a tensor on {device}, but Triton cannot run here: {why}. "
                "Use backend='torch' or backend=None (auto)."
            )
    return backend
