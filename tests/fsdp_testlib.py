"""Two forked ranks of a CPU torch.distributed (gloo) run: the harness the FSDP tests share.

    ranks = TwoRanks(worker, model, str(tmp_path), out=tmp_path)   # both ranks start now
    ...                                                             # the 1-process reference runs meanwhile
    r0, r1 = ranks.results()                                        # what each `worker` returned

Each rank is a real process, forked so it inherits the imported modules (a spawn re-imports
transformers, seconds per rank), with one torch thread; it calls `worker(env, *args)` with the
torchrun-style variables of its rank (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
`MASTER_PORT`: rendezvous over TCP on loopback), pickles what it returns to `out/rank<r>.pkl`,
waits for the other rank, leaves the process group and exits at once (PLATFORM.md: rare aborts
in FSDP teardown otherwise). A worker that raises or hangs fails `results()` (a hung one is
killed after `timeout_s`), so the suite never hangs on it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from verst.rollout.engines.sglang.launcher import free_port

WORLD_SIZE = 2


def rank_env(rank: int, port: int) -> dict[str, str]:
    """What torchrun gives rank `rank` of a 2-process group on this machine."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(WORLD_SIZE),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def _rank_main(worker: Callable[..., Any], rank: int, port: int, out: str, args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    result = worker(rank_env(rank, port), *args)
    (Path(out) / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # exit right after destroy (see the module docstring)


class TwoRanks:
    """Both ranks of `worker`, started on construction; `results()` waits for them."""

    def __init__(self, worker: Callable[..., Any], *args: Any, out: Path, timeout_s: float = 240) -> None:
        self.out = Path(out)
        self.timeout_s = timeout_s
        port = free_port()
        ctx = mp.get_context("fork")
        self.procs = [
            ctx.Process(target=_rank_main, args=(worker, r, port, str(out), args)) for r in range(WORLD_SIZE)
        ]
        for p in self.procs:
            p.start()

    def results(self) -> list[Any]:
        """What each rank's worker returned, rank 0 first; fails when a rank failed or hung."""
        for p in self.procs:
            p.join(self.timeout_s)
        for p in self.procs:
            if p.is_alive():  # a hung worker fails the test instead of hanging the suite
                p.kill()
                p.join()
        codes = [p.exitcode for p in self.procs]
        assert codes == [0] * WORLD_SIZE, f"a rank failed or hung (exit codes {codes}; see captured stderr)"
        return [pickle.loads((self.out / f"rank{r}.pkl").read_bytes()) for r in range(WORLD_SIZE)]
