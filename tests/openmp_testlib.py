"""Shared by the OpenMP release tests: the real runtime's threads, counted in `/proc/self/task`."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest
import torch

from verst.rollout.openmp import _libgomp_pauses

requires_libgomp = pytest.mark.skipif(
    not _libgomp_pauses(), reason="PyTorch here does not run on GNU libgomp (the runtime this is for)"
)


def threads() -> int:
    """The process's threads, OpenMP workers included."""
    return len(os.listdir("/proc/self/task"))


def parallel_kernel() -> None:
    torch.ones(4_000_000).add_(1.0)  # far above ATen's grain size: runs on the OpenMP team


def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()
