"""Eval rollouts of `InferenceRollout` (and `FullyAsyncRollout`): every dataset in
`context.eval_datasets`, greedy by default, no lifecycle events.

Each dataset is scored by the training reward (`rollout.reward`) unless it names its own,
`rollout.eval.datasets.<name>.reward` (the same table shape): a run trained against a judge is
then scored on held-out data by a rule, say. Those eval-only rewards are built with the
strategy (a bad table fails before any rollout) and closed with it.

Metrics: `eval/<name>/reward_mean` etc. (`sample_metrics`), `eval/<name>/failed_samples`, and the
counters of model rewards the eval called (`eval/<name>/reward/judge/calls` for a dataset's own
judge, `eval/reward/judge/calls` for the training judge's eval calls; `rewards.counters`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING

from verst.rollout.engine import SamplingParams
from verst.rollout.generate import GroupGenerationError, generate_and_rm_group, reset_sample
from verst.rollout.logging_utils import log_first_sample, log_rollout_finish
from verst.rollout.protocols import GenerateState, RolloutContext, RolloutRequest, RolloutResult
from verst.rollout.rewards.counters import RewardCounters
from verst.rollout.sample import Sample, Status
from verst.rollout.sampling import sampling_params_for
from verst.rollout.strategies.metrics import sample_metrics
from verst.rollout.strategies.rollout_state import mark_failed, retryable

if TYPE_CHECKING:
    from verst.rollout.strategies.inference import InferenceRollout

logger = logging.getLogger(__name__)


def eval_contexts(context: RolloutContext) -> dict[str, RolloutContext]:
    """A context per eval dataset with its own `reward`: the strategy's, with that reward
    (its config's `rollout.reward` replaced, so group scoring and `reward.key` follow it)."""
    from verst.rollout.rewards import build_reward_fns

    out: dict[str, RolloutContext] = {}
    for name, ds in context.config.eval.datasets.items():
        if ds.reward is None:
            continue
        config = context.config.model_copy(update={"reward": ds.reward})
        reward_fn, group_reward_fn = build_reward_fns(config)
        out[name] = dataclasses.replace(
            context, config=config, reward_fn=reward_fn, group_reward_fn=group_reward_fn
        )
    return out


class Evaluator:
    """Runs eval requests for a strategy (see the module docstring)."""

    def __init__(self, context: RolloutContext) -> None:
        self.context = context
        """The strategy's context (the training reward)."""
        self.contexts = eval_contexts(context)
        """Datasets with their own reward → the context that scores them."""
        self.counters = {
            name: RewardCounters([c.reward_fn, c.group_reward_fn]) for name, c in self.contexts.items()
        }
        """Counters of each dataset's own reward."""

    async def __call__(self, strategy: InferenceRollout, request: RolloutRequest) -> RolloutResult:
        """One eval over every dataset; `strategy` gives the request state and retry logging."""
        config = self.context.config
        params = sampling_params_for(config, evaluation=True)
        training_counts = strategy.reward_counters.delta()  # what training added; not eval's
        result = RolloutResult()
        for name, prompts in self.context.eval_datasets.items():
            ds_config = config.eval.datasets.get(name)
            n = ds_config.n_samples_per_prompt if ds_config is not None else 1
            state = strategy.new_state(request, "e")
            if name in self.contexts:
                state = dataclasses.replace(state, context=self.contexts[name])
            groups = []
            for gi, prompt in enumerate(prompts):
                group = [reset_sample(prompt.clone()) for _ in range(n)]
                for j, s in enumerate(group):
                    s.group_index, s.sample_index = gi, gi * n + j
                groups.append(group)
            done = await asyncio.gather(*(self._eval_group(strategy, state, g, params) for g in groups))
            result.eval[name] = list(done)
            samples = [s for g in done for s in g]
            result.metrics.update(sample_metrics(samples, state.config.reward.key, f"eval/{name}"))
            result.metrics[f"eval/{name}/failed_samples"] = float(
                sum(s.status is Status.FAILED for s in samples)
            )
            if name in self.counters:
                result.metrics.update(self.counters[name].delta(f"eval/{name}/"))
            if samples:
                log_first_sample(logger, samples[0], label=f"eval {name} {request.rollout_id}")
        result.metrics.update(strategy.reward_counters.delta("eval/"))
        strategy.reward_counters.carry(training_counts)
        log_rollout_finish(logger, request.rollout_id, result.metrics)
        return result

    async def _eval_group(
        self, strategy: InferenceRollout, state: GenerateState, group: list[Sample], params: SamplingParams
    ) -> list[Sample]:
        retries = self.context.config.max_group_retries
        attempt = 0
        while True:
            try:
                return await generate_and_rm_group(state, group, params, evaluation=True)
            except GroupGenerationError as err:
                retry = attempt < retries and retryable(err)
                strategy.log_group_failure(err, retry)
                if not retry:
                    return mark_failed(group, err)
            attempt += 1
            for s in group:
                reset_sample(s, keep_attempt=True)

    async def aclose(self) -> None:
        """Close the eval-only rewards (a judge's engine, an HTTP session)."""
        for c in self.contexts.values():
            for reward in (c.reward_fn, getattr(c.group_reward_fn, "reward_fn", None)):
                aclose = getattr(reward, "aclose", None)
                if aclose is not None:
                    await aclose()
