"""Hand a thread's OpenMP workers back before it waits on another thread's compute.

PyTorch's CPU kernels run on OpenMP. With GNU libgomp (PyTorch's runtime on Linux) every thread
that runs a parallel kernel keeps a team of worker threads for its next one, and libgomp counts
the workers of every team in the process: once they outnumber the CPUs it stops letting idle
workers spin between parallel regions (100 spins instead of 300,000, libgomp's
`gomp_throttled_spin_count_var`), so each of the hundreds of small kernels of a decode step
wakes its workers through the kernel (futex) and the cores sit idle in between.

A verst run has two compute threads in one process — the trainer's and the embedded engine's
worker — and in a synchronous run they take turns: while one computes the other waits, but its
team still counts. Measured on 2 cores: a loop of small matmuls ran 1.35× slower while a second,
idle thread's team existed (and as fast as alone once it was released); the fair floor's decode
ran 1.3–1.5× slower after an engine had decoded in the same process (cores idle 20–30% of the
time, kernel time ×10).

`release_openmp_workers()` frees the calling thread's team: OpenMP 5's
`omp_pause_resource_all(omp_pause_soft)`, which in libgomp (`gomp_pause_host`) joins the calling
thread's own workers only, and refuses (-1) inside a parallel region. The thread's next parallel
kernel starts a fresh team (one thread creation per worker, tens of microseconds each). The
engine calls it once idle for `IDLE_RELEASE_S`, the trainer before it blocks on the rollout
side. Other OpenMP runtimes (LLVM's libomp, Intel's) are left alone: this handles libgomp's
throttle only.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

OMP_PAUSE_SOFT = 1
"""`omp_pause_soft` (OpenMP 5.0): release the threads, keep the runtime initialised."""


def release_openmp_workers() -> bool:
    """Free the calling thread's libgomp worker team (see the module doc); True when one or
    more libgomp runtimes accepted. A no-op before torch is imported or without libgomp."""
    if "torch" not in sys.modules:  # nothing has loaded PyTorch's OpenMP runtime yet
        return False
    answers = [pause(OMP_PAUSE_SOFT) for pause in _libgomp_pauses()]  # every copy, even after a refusal
    return bool(answers) and all(a == 0 for a in answers)


@functools.cache
def _libgomp_pauses() -> tuple[Callable[[int], int], ...]:
    """`omp_pause_resource_all` of each libgomp loaded in this process (PyTorch bundles its own
    copy; another package may load the system's): each copy has its own thread pools."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: not libgomp
        return ()
    paths = sorted({line.split()[-1] for line in maps.splitlines() if "/libgomp" in line})
    pauses = []
    for path in paths:
        try:  # already loaded: this only looks it up (RTLD_NOLOAD)
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        except OSError:
            continue
        pause = getattr(lib, "omp_pause_resource_all", None)  # libgomp of GCC 9 and later
        if pause is not None:
            pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
            pauses.append(pause)
    return tuple(pauses)
