"""Agentic episodes with a slow tool: semaphore per engine request vs held per episode.

Why: an agentic episode alternates model turns and tool calls. If the rollout's concurrency
semaphore (`rollout.max_concurrency`) were held for a whole episode, a tool that sleeps would
keep its slot idle and block generation for everyone; verst takes it per engine request, so
episodes waiting on tools leave the engine to the others. This measures episodes/s both ways
in the same run, on the same engine and the same episodes.

Setup: the real embedded engine (a tiny random Llama built here, one torch thread), the default
strategy (`InferenceRollout`) with `[rollout.env]`: every episode is `--turns` model turns
(at most `--tokens` new tokens each) with a tool call after each but the last that sleeps
`--tool-ms` (an async tool, traced with `tool_span`). `--episodes` episodes (one group of one
sample each, all submitted at once), `max_concurrency = --concurrency`. Each mode runs
`--repeats` times after one warm-up; the best time counts.

Run (about 10–20 s on 2 cores):
  uv run python benchmarks/agentic_overlap.py
  uv run python benchmarks/agentic_overlap.py --episodes 64 --concurrency 8 --tool-ms 200

Last line: `tool_wait_overlap=<per-request episodes/s ÷ per-episode episodes/s>
per_request_eps=<x> per_episode_eps=<y>`.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from verst.rollout.agentic import StepResult, tool_span
from verst.rollout.agentic.episode import AgenticGenerate
from verst.rollout.config import RolloutConfig
from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.lifecycle import NoopSink
from verst.rollout.protocols import RolloutContext, RolloutRequest
from verst.rollout.sample import Sample
from verst.rollout.strategies.inference import InferenceRollout


class SlowToolEnv:
    """`turns` model turns; after each but the last, one tool call that sleeps `tool_s`."""

    def __init__(self, turns: int, tool_s: float) -> None:
        self.turns, self.tool_s, self.n = turns, tool_s, 0

    async def reset(self, sample: Sample) -> None:
        return None

    async def step(self, turn) -> StepResult:
        self.n += 1
        if self.n >= self.turns:
            return StepResult(done=True, reward=1.0)
        with tool_span("sleep"):
            await asyncio.sleep(self.tool_s)
        return StepResult(observation=" ok ", metrics={"tool_calls": 1})

    async def close(self) -> None:
        pass


class Prompts:
    """`n` one-sample groups of the same prompt, served once per `refill`."""

    def __init__(self, n: int) -> None:
        self.n, self.left = n, n

    def refill(self) -> None:
        self.left = self.n

    def get_samples(self, k: int) -> list[list[Sample]]:
        k = min(k, self.left)
        self.left -= k
        return [[Sample(prompt="12+34=")] for _ in range(k)]

    def add_samples(self, groups) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


async def measure(engine, tokenizer, args, scope: str) -> float:
    """Best episodes/s over `args.repeats` rollouts (after one warm-up)."""
    config = RolloutConfig(
        batch_size=args.episodes,
        n_samples_per_prompt=1,
        max_concurrency=args.concurrency,
        max_response_len=args.tokens,
        temperature=1.0,
        seed=0,
        env={"max_turns": args.turns, "step_timeout_s": 60.0},
    )
    source = Prompts(args.episodes)
    ctx = RolloutContext(
        config=config, data_source=source, engine=engine, tokenizer=tokenizer, sink=NoopSink()
    )
    strategy = InferenceRollout(ctx)
    strategy.generate_fn = AgenticGenerate(
        config.env, lambda: SlowToolEnv(args.turns, args.tool_ms / 1000), semaphore_scope=scope
    )
    best = float("inf")
    for i in range(args.repeats + 1):
        source.refill()
        started = time.perf_counter()
        result = await strategy(RolloutRequest(i))
        elapsed = time.perf_counter() - started
        assert len(result.groups) == args.episodes and result.metrics["rollout/turns_mean"] == args.turns
        if i:
            best = min(best, elapsed)
    return args.episodes / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tool-ms", type=float, default=200.0)
    parser.add_argument(
        "--turns", type=int, default=3, help="model turns per episode (tool calls = turns - 1)"
    )
    parser.add_argument("--tokens", type=int, default=4, help="new tokens per model turn at most")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    import torch

    from verst.rollout.toy import make_tiny_checkpoint

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "model", seed=0)
        engine = EmbeddedEngine.from_pretrained(path)
        try:
            per_request = asyncio.run(measure(engine, engine.tokenizer, args, "request"))
            per_episode = asyncio.run(measure(engine, engine.tokenizer, args, "episode"))
        finally:
            asyncio.run(engine.close())
    print(
        f"{args.episodes} episodes × {args.turns} turns ({args.turns - 1} tool calls of {args.tool_ms:.0f} ms), "
        f"max_concurrency {args.concurrency}: per-request {per_request:.1f} episodes/s, "
        f"per-episode {per_episode:.1f} episodes/s"
    )
    print(
        f"tool_wait_overlap={per_request / per_episode:.2f} per_request_eps={per_request:.2f} per_episode_eps={per_episode:.2f}"
    )


if __name__ == "__main__":
    main()
