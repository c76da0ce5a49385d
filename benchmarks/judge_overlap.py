"""LLM-as-judge rewards with a slow judge: judge calls in flight together vs one at a time.

Why: a judge model answers in hundreds of milliseconds. verst scores a sample as soon as its
generation ends, outside the rollout's engine semaphore, with the judge's own concurrency
(`rollout.reward.judge.max_concurrency`), so judge waits overlap each other and the generation of
other samples. This measures samples/s of a whole rollout with the judge's concurrency at
`--in-flight` vs 1 (the judge awaited one call at a time), in the same run, on the same engines.

Setup: the real embedded engine as the policy (a tiny random Llama built here, one torch
thread) and a second embedded engine as the judge (another tiny Llama; `yes_no_logprob` parser),
each judge call delayed by `--judge-ms` first (a remote judge's latency). The default strategy
(`InferenceRollout`), `--samples` one-sample groups submitted at once, `max_concurrency = 8`,
verdict cache off (every sample is judged). Each mode runs `--repeats` times, interleaved, after
one warm-up of each; the best time counts.

Run (about 20 s on 2 cores):
  uv run python benchmarks/judge_overlap.py
  uv run python benchmarks/judge_overlap.py --samples 64 --in-flight 8 --judge-ms 200

Last line: `judge_wait_overlap=<samples/s at --in-flight ÷ samples/s at 1>
overlapped_sps=<x> serial_sps=<y>`.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from verst.rollout.config import JudgeConfig, RolloutConfig
from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.lifecycle import NoopSink
from verst.rollout.protocols import RolloutContext, RolloutRequest
from verst.rollout.rewards.judge import EngineJudge, JudgeReward
from verst.rollout.rewards.judge_parsers import Verdict
from verst.rollout.sample import Sample
from verst.rollout.strategies.inference import InferenceRollout


class SlowJudge:
    """A real judge backend behind `delay_s` of latency."""

    def __init__(self, inner: EngineJudge, delay_s: float) -> None:
        self.inner, self.delay_s, self.name = inner, delay_s, inner.name

    async def verdict(self, prompt: str, *, max_new_tokens: int, yes_no) -> Verdict:
        await asyncio.sleep(self.delay_s)
        return await self.inner.verdict(prompt, max_new_tokens=max_new_tokens, yes_no=yes_no)

    async def aclose(self) -> None:
        pass


class Prompts:
    """`n` one-sample groups, served once per `refill`."""

    def __init__(self, n: int) -> None:
        self.n, self.left = n, n

    def refill(self) -> None:
        self.left = self.n

    def get_samples(self, k: int) -> list[list[Sample]]:
        k = min(k, self.left)
        self.left -= k
        return [[Sample(prompt=f"{i}+34=", label="ok")] for i in range(k)]

    def add_samples(self, groups) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def make_strategy(policy, judge_engine, args, in_flight: int) -> tuple[InferenceRollout, Prompts]:
    config = RolloutConfig(
        batch_size=args.samples,
        n_samples_per_prompt=1,
        max_concurrency=8,
        max_response_len=args.tokens,
        temperature=1.0,
        seed=0,
    )
    judge_cfg = JudgeConfig(
        engine={"type": "embedded"},
        parser="yes_no_logprob",
        yes="y",
        no="n",
        template="{prompt}{response} ok? ",
        max_concurrency=in_flight,
        cache=False,
    )
    judge = JudgeReward(SlowJudge(EngineJudge(judge_engine), args.judge_ms / 1000), judge_cfg)
    source = Prompts(args.samples)
    ctx = RolloutContext(
        config=config,
        data_source=source,
        engine=policy,
        tokenizer=policy.tokenizer,
        reward_fn=judge,
        sink=NoopSink(),
    )
    return InferenceRollout(ctx), source


async def once(strategy: InferenceRollout, source: Prompts, n: int, i: int) -> float:
    source.refill()
    started = time.perf_counter()
    result = await strategy(RolloutRequest(i))
    elapsed = time.perf_counter() - started
    assert len(result.groups) == n and not result.metrics.get("rollout/reward_errors")
    return elapsed


async def measure(policy, judge_engine, args) -> tuple[float, float]:
    overlapped = make_strategy(policy, judge_engine, args, args.in_flight)
    serial = make_strategy(policy, judge_engine, args, 1)
    best = {"o": float("inf"), "s": float("inf")}
    for i in range(args.repeats + 1):
        for key, (strategy, source) in (("o", overlapped), ("s", serial)):
            elapsed = await once(strategy, source, args.samples, i)
            if i:
                best[key] = min(best[key], elapsed)
    return args.samples / best["o"], args.samples / best["s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--in-flight", type=int, default=8, help="judge calls in flight at once")
    parser.add_argument("--judge-ms", type=float, default=200.0)
    parser.add_argument("--tokens", type=int, default=8, help="new tokens per sample at most")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    import torch

    from verst.rollout.toy import make_tiny_checkpoint

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        policy = EmbeddedEngine.from_pretrained(make_tiny_checkpoint(Path(tmp) / "policy", seed=0))
        judge = EmbeddedEngine.from_pretrained(make_tiny_checkpoint(Path(tmp) / "judge", seed=1))
        try:
            overlapped, serial = asyncio.run(measure(policy, judge, args))
        finally:
            asyncio.run(policy.close())
            asyncio.run(judge.close())
    print(
        f"{args.samples} samples, judge latency {args.judge_ms:.0f} ms: {args.in_flight} judge calls in flight "
        f"{overlapped:.1f} samples/s, one at a time {serial:.1f} samples/s"
    )
    print(
        f"judge_wait_overlap={overlapped / serial:.2f} overlapped_sps={overlapped:.2f} serial_sps={serial:.2f}"
    )


if __name__ == "__main__":
    main()
