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


def tids() -> set[int]:
    """The process's threads, OpenMP workers included (by id: a thread some earlier test left
    behind may end at any time, so tests follow the ids they saw appear, not counts)."""
    return {int(t) for t in os.listdir("/proc/self/task")}


def parallel_kernel() -> set[int]:
    """Run a kernel on the calling thread's OpenMP team; the thread ids that appeared meanwhile
    (its workers, when it had no team yet)."""
    before = tids()
    torch.ones(4_000_000).add_(1.0)  # far above ATen's grain size: runs on the OpenMP team
    return tids() - before


def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()
