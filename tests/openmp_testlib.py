"""Shared by the OpenMP release tests: the real runtime's threads, in `/proc/self/task`.

A thread some earlier test left behind may start or end at any time, so the tests neither count
threads nor take every new one for a worker: they name the thread that owns a team
(`/proc/self/task/<tid>/comm`) before its first parallel kernel, and libgomp's workers, created
by that thread, inherit the name.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from verst.rollout.openmp import _libgomp_pauses

requires_libgomp = pytest.mark.skipif(
    not _libgomp_pauses(), reason="PyTorch here does not run on GNU libgomp (the runtime this is for)"
)


def tids() -> set[int]:
    """The process's threads, OpenMP workers included."""
    return {int(t) for t in os.listdir("/proc/self/task")}


def _comm(tid: int) -> str | None:
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    except OSError:  # the thread ended meanwhile
        return None


def _set_comm(tid: int, name: str) -> None:
    Path(f"/proc/self/task/{tid}/comm").write_text(name)


def name_thread(tid: int) -> str:
    """Give thread `tid` a name of its own; the workers it creates from now on inherit it."""
    name = f"omp{tid}"[:15]
    _set_comm(tid, name)
    return name


def workers_of(tid: int, name: str) -> set[int]:
    """The live threads named `name` other than `tid` itself: its workers."""
    return {t for t in tids() if t != tid and _comm(t) == name}


def parallel_kernel() -> set[int]:
    """Run a kernel on the calling thread's OpenMP team; that team's workers."""
    me = threading.get_native_id()
    old, name = _comm(me), name_thread(me)
    try:
        torch.ones(4_000_000).add_(1.0)  # far above ATen's grain size: runs on the OpenMP team
        return workers_of(me, name)
    finally:
        if old is not None:
            _set_comm(me, old)


def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()
