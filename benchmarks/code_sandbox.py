"""The code sandbox's cost: executions/s, the overhead against a plain subprocess, and how well
the `python` tool's executions overlap generation in agentic episodes.

Why: every `code_tests` reward and every `python` tool call is a fresh bubblewrap sandbox
(bwrap setup, the launcher's interpreter, then the program's). This measures, in one run:
- executions/s of a trivial program (`pass`) and of a typical test suite (a `code_tests`
  sample: a one-line function against 5 asserts, one sandbox execution) at pool sizes 1 and 2;
- the per-execution overhead: the mean wall time of one sandboxed `pass` minus that of
  `subprocess.run([sys.executable, "-c", "pass"])`, both serial, measured here in the same run;
- `tool_wait_overlap` as `benchmarks/agentic_overlap.py` defines it (episodes/s with the engine
  semaphore taken per request ÷ held per episode) with the real `python` tool running a 100 ms
  program in the sandbox between two model turns (tiny embedded Llama, one torch thread).

Run (about 30–60 s on 2 cores):
  uv run python benchmarks/code_sandbox.py
  uv run python benchmarks/code_sandbox.py --execs 40 --episodes 32

Last line: `sandbox_execs_per_s=<trivial, pool of 2> sandbox_overhead_ms=<y> tool_wait_overlap=<z>`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from verst.rollout.agentic import StepResult, tool_span
from verst.rollout.agentic.episode import AgenticGenerate
from verst.rollout.agentic.python_tool import PythonTool, PythonToolConfig
from verst.rollout.config import RolloutConfig
from verst.rollout.lifecycle import NoopSink
from verst.rollout.protocols import RolloutContext, RolloutRequest
from verst.rollout.rewards.code_tests import CodeTestsReward
from verst.rollout.sample import Sample, Status
from verst.rollout.sandbox import SandboxConfig, SandboxPool
from verst.rollout.strategies.inference import InferenceRollout

SUITE = {"prefix": "def f(x):\n    return ", "tests": [f"assert f({i}) == {2 * i + 1}" for i in range(5)]}
"""The typical test suite: 5 asserts on a one-line function."""


async def execs_per_s(workers: int, n: int) -> float:
    pool = SandboxPool(SandboxConfig(workers=workers))
    await pool.run("pass")  # the check and a warm-up
    start = time.perf_counter()
    results = await asyncio.gather(*(pool.run("pass") for _ in range(n)))
    assert all(r.ok for r in results)
    return n / (time.perf_counter() - start)


async def suites_per_s(workers: int, n: int) -> float:
    reward = CodeTestsReward(SandboxConfig(workers=workers))

    def sample() -> Sample:
        s = Sample(prompt="", response="2*x+1", label=SUITE)
        s.status = Status.COMPLETED
        return s

    assert await reward(sample()) == 1.0
    start = time.perf_counter()
    scores = await asyncio.gather(*(reward(sample()) for _ in range(n)))
    assert scores == [1.0] * n
    return n / (time.perf_counter() - start)


async def sandbox_serial_s(n: int) -> float:
    pool = SandboxPool(SandboxConfig(workers=1))
    await pool.run("pass")
    walls = []
    for _ in range(n):
        start = time.perf_counter()
        assert (await pool.run("pass")).ok
        walls.append(time.perf_counter() - start)
    return statistics.fmean(walls)


def subprocess_serial_s(n: int) -> float:
    walls = []
    for _ in range(n + 1):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        walls.append(time.perf_counter() - start)
    return statistics.fmean(walls[1:])


class PythonToolEnv:
    """Two model turns; between them one `python` tool call (a 100 ms program) in the sandbox."""

    def __init__(self, tool: PythonTool) -> None:
        self.tool, self.n = tool, 0

    async def reset(self, sample: Sample) -> None:
        return None

    async def step(self, turn) -> StepResult:
        self.n += 1
        if self.n >= 2:
            return StepResult(done=True, reward=1.0)
        with tool_span("python"):
            out = await self.tool(code="import time\ntime.sleep(0.1)\nprint('ok')")
        assert out == "ok\n", out
        return StepResult(observation=f" {out}", metrics={"tool_calls": 1})

    async def close(self) -> None:
        pass


async def episodes_per_s(engine, args, scope: str) -> float:
    config = RolloutConfig(
        batch_size=args.episodes, n_samples_per_prompt=1, max_concurrency=args.concurrency,
        max_response_len=4, temperature=1.0, seed=0, env={"max_turns": 2, "step_timeout_s": 60.0},
    )  # fmt: skip
    from agentic_overlap import Prompts

    source = Prompts(args.episodes)
    ctx = RolloutContext(
        config=config, data_source=source, engine=engine, tokenizer=engine.tokenizer, sink=NoopSink()
    )
    strategy = InferenceRollout(ctx)
    tool = PythonTool(PythonToolConfig(sandbox=SandboxConfig(workers=args.concurrency)))
    strategy.generate_fn = AgenticGenerate(config.env, lambda: PythonToolEnv(tool), semaphore_scope=scope)
    best = float("inf")
    for i in range(2):  # a warm-up, then the measured rollout
        source.refill()
        start = time.perf_counter()
        result = await strategy(RolloutRequest(i))
        assert len(result.groups) == args.episodes
        best = time.perf_counter() - start
    return args.episodes / best


def tool_overlap(args) -> tuple[float, float, float]:
    import torch

    from verst.rollout.engines.embedded.engine import EmbeddedEngine
    from verst.rollout.toy import make_tiny_checkpoint

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        engine = EmbeddedEngine.from_pretrained(make_tiny_checkpoint(Path(tmp) / "model", seed=0))
        try:
            per_request = asyncio.run(episodes_per_s(engine, args, "request"))
            per_episode = asyncio.run(episodes_per_s(engine, args, "episode"))
        finally:
            asyncio.run(engine.close())
    return per_request / per_episode, per_request, per_episode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--execs", type=int, default=20, help="executions per throughput measurement")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    trivial = {w: asyncio.run(execs_per_s(w, args.execs)) for w in (1, 2)}
    suite = {w: asyncio.run(suites_per_s(w, args.execs)) for w in (1, 2)}
    sandboxed, plain = asyncio.run(sandbox_serial_s(args.execs)), subprocess_serial_s(args.execs)
    overlap, per_request, per_episode = tool_overlap(args)
    for w in (1, 2):
        print(f"pool of {w}: trivial {trivial[w]:.1f} execs/s, 5-assert suite {suite[w]:.1f} samples/s")
    print(f"serial 'pass': sandbox {sandboxed * 1e3:.1f} ms, plain subprocess {plain * 1e3:.1f} ms")
    print(
        f"python tool, {args.episodes} episodes, max_concurrency {args.concurrency}: per-request "
        f"{per_request:.1f} episodes/s, per-episode {per_episode:.1f} episodes/s"
    )
    print(
        f"sandbox_execs_per_s={trivial[2]:.1f} sandbox_overhead_ms={(sandboxed - plain) * 1e3:.1f} "
        f"tool_wait_overlap={overlap:.2f}"
    )


if __name__ == "__main__":
    main()
