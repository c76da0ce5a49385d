"""Per-sample overhead of the default rollout strategy (`InferenceRollout`).

Why: with a real engine a sample costs milliseconds of GPU time; the rollout machinery around
it (tasks, semaphore, lifecycle events, reward dispatch, filters, metrics) must stay negligible
so it never becomes the bottleneck. This pushes 20,000 samples through `InferenceRollout`
with an engine that answers instantly (in-process, no I/O) and the built-in `exact_match` rule
reward, and compares with a baseline in the same run: a bare loop that does the same engine
call, sample bookkeeping and reward for each sample with no strategy around it.

    uv run python benchmarks/rollout_overhead.py            # 20,000 samples
    uv run python benchmarks/rollout_overhead.py --samples 4000 --profile

Last line: `overhead_us_per_sample=<float>` = (strategy time - baseline time) / samples, the
best of `--repeats` runs. Target: < 100 µs per sample on one core.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import time
from collections import deque
from typing import Any

from verst.rollout.config import RolloutConfig
from verst.rollout.engine import GenerateOutput, GenerateRequest
from verst.rollout.lifecycle import ListSink
from verst.rollout.protocols import RolloutContext, RolloutRequest
from verst.rollout.rewards.registry import build_sample_reward_fn
from verst.rollout.sample import Sample
from verst.rollout.strategies.inference import InferenceRollout

RESPONSE_IDS = [11, 12, 13, 14, 15, 16, 17, 2]
RESPONSE_LOGPROBS = [-0.5] * len(RESPONSE_IDS)


class InstantEngine:
    """An `InferenceEngine` that answers at once with a fixed response (no I/O, no model)."""

    weight_version = 0

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        # Half the samples of every group are right (request ids end in "-<sample index>-<attempt>").
        answer = "42" if int(request.rid.rsplit("-", 2)[-2]) % 2 else "7"
        return GenerateOutput(RESPONSE_IDS, RESPONSE_LOGPROBS, "stop", 0, len(request.input_ids), answer)

    async def abort(self, rid_prefix: str | None = None) -> None:
        pass

    async def update_weights_from_tensors(
        self, named_tensors: dict[str, Any], weight_version: int | None = None
    ) -> int:
        return 0

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> int:
        return 0

    async def health(self) -> bool:
        return True

    async def get_weight_version(self) -> int:
        return 0

    async def close(self) -> None:
        pass


class CyclingDataSource:
    """Endless prompts with cached token ids (what `PromptDataSource` hands out after tokenizing)."""

    def __init__(self, n: int, num_prompts: int = 1000) -> None:
        self.n = n
        self.prompts = [
            Sample(prompt=f"question {i}", label="42", tokens=[i % 97 + 3] * 24, metadata={"id": i})
            for i in range(num_prompts)
        ]
        self.i = 0
        self.buffer: deque[list[Sample]] = deque()

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        out = [self.buffer.popleft() for _ in range(min(num_groups, len(self.buffer)))]
        while len(out) < num_groups:
            proto = self.prompts[self.i % len(self.prompts)]
            self.i += 1
            out.append([proto.clone() for _ in range(self.n)])
        return out

    def add_samples(self, groups: list[list[Sample]]) -> None:
        self.buffer.extend(groups)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def make_config(groups_per_rollout: int, n: int) -> RolloutConfig:
    return RolloutConfig(
        batch_size=groups_per_rollout,
        n_samples_per_prompt=n,
        max_concurrency=256,
        max_response_len=16,
        reward={"type": "exact_match"},
        dynamic_filters=["nonzero_std"],
    )


async def run_strategy(total: int, groups_per_rollout: int, n: int) -> tuple[float, int, int]:
    """Seconds for `total` kept samples through InferenceRollout; also events and samples seen."""
    config = make_config(groups_per_rollout, n)
    sink = ListSink()
    ctx = RolloutContext(
        config=config,
        data_source=CyclingDataSource(n),
        engine=InstantEngine(),
        reward_fn=build_sample_reward_fn(config),
        sink=sink,
    )
    strategy = InferenceRollout(ctx)
    kept = 0
    rollout_id = 0
    start = time.perf_counter()
    while kept < total:
        result = await strategy(RolloutRequest(rollout_id=rollout_id))
        kept += sum(len(g) for g in result.groups)
        rollout_id += 1
    elapsed = time.perf_counter() - start
    return elapsed, len(sink.events), kept


async def run_baseline(total: int, n: int) -> float:
    """The same engine call, bookkeeping and reward per sample, in a bare loop (no strategy)."""
    config = make_config(1, n)
    engine = InstantEngine()
    reward_fn = build_sample_reward_fn(config)
    source = CyclingDataSource(n)
    start = time.perf_counter()
    done = 0
    while done < total:
        for group in source.get_samples(1):
            for s in group:
                out = await engine.generate(GenerateRequest(s.tokens, rid=f"base-{done}-0"))
                s.tokens = s.tokens + out.output_ids
                s.response_length = len(out.output_ids)
                s.rollout_logprobs = list(out.output_logprobs)
                s.response = out.text
                s.reward = await reward_fn(s)
                done += 1
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--groups-per-rollout", type=int, default=250)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one strategy run")
    args = parser.parse_args()

    strategy_times, baseline_times = [], []
    events = kept = 0
    for _ in range(args.repeats):
        t, events, kept = asyncio.run(run_strategy(args.samples, args.groups_per_rollout, args.n))
        strategy_times.append(t)
        baseline_times.append(asyncio.run(run_baseline(kept, args.n)))
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        asyncio.run(run_strategy(args.samples, args.groups_per_rollout, args.n))
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)

    t_strategy, t_base = min(strategy_times), min(baseline_times)
    per_sample = t_strategy / kept * 1e6
    base_per_sample = t_base / kept * 1e6
    overhead = per_sample - base_per_sample
    print(
        f"samples kept={kept} (groups of {args.n}, {args.groups_per_rollout} groups/rollout), "
        f"lifecycle events={events}, repeats={args.repeats}"
    )
    print(
        f"strategy: best {t_strategy:.3f}s, median {statistics.median(strategy_times):.3f}s "
        f"-> {per_sample:.1f} us/sample"
    )
    print(f"baseline (bare loop): best {t_base:.3f}s -> {base_per_sample:.1f} us/sample")
    print(f"strategy/baseline={t_strategy / t_base:.2f}x  target overhead < 100 us/sample")
    print(f"overhead_us_per_sample={overhead:.1f}")


if __name__ == "__main__":
    main()
