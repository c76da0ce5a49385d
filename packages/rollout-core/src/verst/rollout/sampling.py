"""Sampling params from the rollout config, and per-sample seeds.

`sampling_params_for(config)` is what a rollout sends with every request; eval rollouts use the
eval temperature and max response length. When `config.seed` is set, every sample gets its own
seed derived from it (`derive_sample_seed`), so a rerun of the same rollout samples the same
tokens while the samples of one group still differ.
"""

from __future__ import annotations

from verst.rollout.config import RolloutConfig
from verst.rollout.engine import SamplingParams

_SEED_MODULUS = 2**31 - 1
"""Seeds stay in the positive int32 range every engine accepts."""


def sampling_params_for(config: RolloutConfig, evaluation: bool = False) -> SamplingParams:
    """The sampling params of a training (or, with `evaluation`, an eval) rollout."""
    if evaluation:
        temperature = config.eval.temperature
        max_new_tokens = config.eval.max_response_len or config.max_response_len
    else:
        temperature = config.temperature
        max_new_tokens = config.max_response_len
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        stop=tuple(config.stop),
        stop_token_ids=tuple(config.stop_token_ids),
        sampling_seed=config.seed,
    )


def derive_sample_seed(base_seed: int, rollout_id: int, sample_index: int | None, attempt: int = 0) -> int:
    """A deterministic seed per (base seed, rollout, sample, attempt), spread over int32.

    Pure integer mixing (no `hash()`, which is salted per process), so it is reproducible
    across runs and processes.
    """
    x = (base_seed & 0xFFFFFFFF) * 0x9E3779B1
    for part in (rollout_id, -1 if sample_index is None else sample_index, attempt):
        x = ((x ^ (part & 0xFFFFFFFF)) * 0x85EBCA77 + 0xC2B2AE3D) & 0xFFFFFFFFFFFF
    return x % _SEED_MODULUS
