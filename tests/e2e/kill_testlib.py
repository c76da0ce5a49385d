"""A fork server that runs `verst train` and SIGKILLs it at a chosen moment (a fault injector).

Starting a Python process that imports torch, transformers and verst costs seconds on 2 cores,
and the kill-anywhere resume tests need dozens of runs. `KillServer` starts one process that
imports all that once (torch held at one thread, no parallel region run, so forking is safe),
then forks a child per run. The child runs the real CLI entry point
(`verst.trainer.cli.main(["train", ...])`, stdout and stderr to a log file) armed to send itself
SIGKILL a chosen delay after the run enters a chosen phase of a chosen step (the child wraps the
trainer's `_step` / `_phase` to know where it is: a fault injector, nothing in verst knows about
it), or at a chosen time after start. The process dies as a `kill -9` would kill it, with the
delay running on while the phase works (a checkpoint write is caught half written).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SERVER = r'''
import json, os, signal, sys, threading, time
import torch
torch.set_num_threads(1)
import transformers  # noqa: F401  (imported once, before any fork)
from verst.trainer.cli import main
import verst.trainer.run.controller  # noqa: F401
import verst.rollout.engines.embedded  # noqa: F401

def arm(phase, step, delay, after):
    """SIGKILL this process `after` s from now, or `delay` s after it enters `phase` in the
    0-based train step `step` (-1: the eval before the first step)."""
    def die(wait):
        time.sleep(wait)
        os.kill(os.getpid(), signal.SIGKILL)

    if after is not None:
        threading.Thread(target=die, args=(after,), daemon=True).start()
        return
    from verst.trainer.run.controller import Trainer
    current = {"step": -1}
    run_step, enter = Trainer._step, Trainer._phase

    def _step(self, s, summary):
        current["step"] = s
        return run_step(self, s, summary)

    def _phase(self, name):
        enter(self, name)
        if (name, current["step"]) == (phase, step):
            threading.Thread(target=die, args=(delay,), daemon=True).start()

    Trainer._step, Trainer._phase = _step, _phase

for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(log, 1)
        os.dup2(log, 2)
        kill = job.get("kill")
        if kill:
            arm(*kill)
        try:
            code = main(job["argv"])
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 99
        os._exit(int(code or 0))
    _, status = os.waitpid(pid, 0)
    out = {"signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
           "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
'''


@dataclass(frozen=True)
class Kill:
    """When to kill: `delay_s` after entering `phase` of the 0-based train step `step` (-1: the
    eval before the first step), or `after_s` seconds after start."""

    phase: str | None = None
    step: int | None = None
    delay_s: float = 0.0
    after_s: float | None = None

    def as_args(self) -> list:
        return [self.phase, self.step, self.delay_s, self.after_s]


class KillServer:
    """One pre-imported process forking a `verst train` child per `run`."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def run(self, argv: list[str], run_dir: Path, kill: Kill | None = None) -> dict:
        """Run `verst <argv>` in a forked child; its exit: {'signal': 9 or None, 'code': n or None}."""
        job = {
            "argv": argv,
            "log": str(run_dir.parent / f"{run_dir.name}.log"),
            "kill": kill.as_args() if kill else None,
        }
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the kill server died")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
