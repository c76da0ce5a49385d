"""The same small rollout through the default strategy and the legacy strategy, one engine.

Both run against the real embedded engine (a tiny Llama built by the project) with the same
config and the same prompt file: the samples have the same structure field by field (tokens,
masks, log-probs, rewards, statuses, versions, indices), the same prompts in the same order,
the same metric names, and both emit complete lifecycle streams.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from legacy_testkit import assert_complete_streams, write_prompts

from verst.rollout.config import DataConfig, EvalConfig, EvalDatasetConfig, RewardConfig, RolloutConfig
from verst.rollout.data import PromptDataSource
from verst.rollout.data_sources import build_eval_sets
from verst.rollout.lifecycle import ListSink
from verst.rollout.protocols import RolloutContext, RolloutRequest, RolloutResult
from verst.rollout.rewards.registry import build_reward_fns
from verst.rollout.sample import Sample, Status
from verst.rollout.strategies.inference import InferenceRollout
from verst.rollout_legacy import LegacyRolloutStrategy

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["12+3=", "7*6=", "9-4=", "5+5=", "8*2=", "6-1="]
LABELS = ["15", "42", "5", "10", "16", "5"]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    torch = pytest.importorskip("torch")  # the `local` extra is part of the dev environment
    torch.set_num_threads(1)
    from verst.rollout.engines.embedded.engine import EmbeddedEngine

    eng = EmbeddedEngine.from_pretrained(tiny_checkpoint)
    yield eng
    asyncio.run(eng.close())


def _config(tmp_path) -> RolloutConfig:
    data = DataConfig(path=str(write_prompts(tmp_path / "train.jsonl", PROMPTS, LABELS)), shuffle=False)
    eval_ds = EvalDatasetConfig(path=str(write_prompts(tmp_path / "eval.jsonl", PROMPTS[:3], LABELS[:3])))
    return RolloutConfig(
        batch_size=2,
        n_samples_per_prompt=2,
        max_response_len=6,
        temperature=1.0,
        seed=7,
        data=data,
        reward=RewardConfig(type="partial_credit"),
        eval=EvalConfig(datasets={"arith": eval_ds}, temperature=0.0, max_response_len=4),
    )


def _context(config: RolloutConfig, engine: Any) -> RolloutContext:
    reward_fn, group_fn = build_reward_fns(config)
    return RolloutContext(
        config=config,
        data_source=PromptDataSource(config.data, config.n_samples_per_prompt, tokenizer=engine.tokenizer),
        engine=engine,
        tokenizer=engine.tokenizer,
        reward_fn=reward_fn,
        group_reward_fn=group_fn,
        sink=ListSink(),
        eval_datasets=build_eval_sets(config.eval, tokenizer=engine.tokenizer),
    )


def _shape(sample: Sample) -> dict[str, Any]:
    """The structure of a sample: field types and lengths, and the invariants that tie them."""
    sample.validate()
    assert all(isinstance(t, int) for t in sample.tokens)
    assert sample.rollout_logprobs is not None
    assert all(isinstance(x, float) and x <= 0.0 for x in sample.rollout_logprobs)
    return {
        "prompt": sample.prompt,
        "label": sample.label,
        "prompt_tokens": sample.tokens[: sample.prompt_length],
        "tokens_type": type(sample.tokens).__name__,
        "response_type": type(sample.response).__name__,
        "finished": sample.status.is_finished,
        "loss_mask": None if sample.loss_mask is None else len(sample.loss_mask) == sample.response_length,
        "logprobs_len_ok": len(sample.rollout_logprobs) == sample.response_length,
        "reward_type": type(sample.reward).__name__,
        "weight_versions": sample.weight_versions,
        "group_index": sample.group_index,
        "sample_index": sample.sample_index,
        "metadata_keys": sorted(sample.metadata),
        "generate_function_path": sample.generate_function_path,
    }


async def _run(strategy: Any) -> tuple[RolloutResult, RolloutResult]:
    train = await strategy(RolloutRequest(rollout_id=0, weight_version=0))
    evaluation = await strategy(RolloutRequest(rollout_id=0, weight_version=0, evaluation=True))
    await strategy.close()
    return train, evaluation


async def test_default_and_legacy_give_samples_of_the_same_structure(tmp_path, engine):
    config = _config(tmp_path)
    default_ctx, legacy_ctx = _context(config, engine), _context(config, engine)
    default_train, default_eval = await _run(InferenceRollout(default_ctx))
    legacy_train, legacy_eval = await _run(LegacyRolloutStrategy(legacy_ctx))

    for train in (default_train, legacy_train):
        assert len(train.groups) == config.batch_size
        assert all(len(g) == config.n_samples_per_prompt for g in train.groups)
        assert all(s.status in (Status.COMPLETED, Status.TRUNCATED) for g in train.groups for s in g)
        assert all(0 < s.response_length <= config.max_response_len for g in train.groups for s in g)
    assert [[_shape(s) for s in g] for g in legacy_train.groups] == [
        [_shape(s) for s in g] for g in default_train.groups
    ]
    assert set(legacy_train.metrics) == set(default_train.metrics)

    assert set(legacy_eval.eval) == set(default_eval.eval) == {"arith"}
    assert [[_shape(s) for s in g] for g in legacy_eval.eval["arith"]] == [
        [_shape(s) for s in g] for g in default_eval.eval["arith"]
    ]
    assert all(s.response_length <= 4 for g in legacy_eval.eval["arith"] for s in g)
    assert set(legacy_eval.metrics) == set(default_eval.metrics)

    # Complete lifecycle streams on both paths (training only: eval emits nothing), one
    # attempt per sample here, with the same per-sample event sequences.
    n_samples = config.batch_size * config.n_samples_per_prompt
    assert assert_complete_streams(default_ctx.sink) == n_samples
    assert assert_complete_streams(legacy_ctx.sink) == n_samples

    def kinds(sink: ListSink) -> dict[int | None, list[str]]:
        out: dict[int | None, list[str]] = {}
        for e in sink.events:
            assert e.weight_version == 0 and e.rollout_id == 0
            out.setdefault(e.sample_index, []).append(e.kind.value)
        return out

    assert kinds(legacy_ctx.sink) == kinds(default_ctx.sink)
