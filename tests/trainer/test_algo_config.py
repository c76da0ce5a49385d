"""AlgorithmConfig: every problem reported at once, tables drive the choices, TOML round trip."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from typing import ClassVar

import pydantic
import pytest
import torch

from verst.rollout.errors import ConfigError
from verst.trainer.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageConfig,
    AlgorithmConfig,
    Grpo,
    Gspo,
    PpoClip,
    build_algorithm,
)


def test_every_field_is_documented():
    for name, f in AlgorithmConfig.model_fields.items():
        assert f.description, f"AlgorithmConfig.{name} has no description"


def test_defaults_are_valid_and_build():
    cfg = AlgorithmConfig()
    assert cfg.problems() == []
    algo = build_algorithm(cfg)
    assert algo.loss_agg == "token_mean"
    assert not algo.needs_reference and not algo.needs_rollout_logprobs and algo.needs_old_logprobs
    assert algo.policy_loss == PpoClip(eps_clip_low=0.2, eps_clip_high=0.2, dual_clip_c=None)


@pytest.mark.parametrize("adv", list(ADVANTAGE_ESTIMATORS))
@pytest.mark.parametrize("loss", list(POLICY_LOSSES))
@pytest.mark.parametrize("kl", list(KL_ESTIMATORS))
def test_every_table_entry_builds(adv, loss, kl):
    critic = {"critic": {}} if ADVANTAGE_ESTIMATORS[adv].needs_values else {}  # gae needs a value model
    algo = build_algorithm(
        AlgorithmConfig(
            advantage=adv, policy_loss=loss, kl_estimator=kl, kl_coef=0.01, use_kl_loss=True, **critic
        )
    )
    assert isinstance(algo.estimator, ADVANTAGE_ESTIMATORS[adv])
    assert isinstance(algo.policy_loss, POLICY_LOSSES[loss])
    assert algo.kl_estimator is KL_ESTIMATORS[kl]
    assert algo.needs_reference


def test_default_aggregation_follows_loss_then_estimator():
    assert build_algorithm(AlgorithmConfig(advantage="dr_grpo")).loss_agg == "seq_mean_token_sum_norm"
    assert build_algorithm(AlgorithmConfig(policy_loss="gspo")).loss_agg == "seq_mean_token_mean"
    for agg in AGGREGATIONS:
        assert build_algorithm(AlgorithmConfig(advantage="dr_grpo", loss_agg=agg)).loss_agg == agg


def test_fields_reach_the_components():
    algo = build_algorithm(
        AlgorithmConfig(eps_clip_low=0.1, eps_clip_high=0.28, dual_clip_c=3.0, normalize_std=False)
    )
    assert algo.policy_loss == PpoClip(eps_clip_low=0.1, eps_clip_high=0.28, dual_clip_c=3.0)
    assert algo.estimator.normalize_std is False
    assert build_algorithm(AlgorithmConfig(policy_loss="gspo")).policy_loss == Gspo(
        eps_clip_low=3e-4, eps_clip_high=4e-4
    )
    assert build_algorithm(AlgorithmConfig(advantage="reinforce_pp", gamma=0.9)).estimator.gamma == 0.9


def test_all_problems_reported_in_one_error():
    cfg = AlgorithmConfig(
        advantage="ppo_gae",
        policy_loss="sapo",
        kl_estimator="k4",
        loss_agg="sum",
        use_kl_loss=True,
        use_kl_in_reward=True,
        dual_clip_c=0.9,
        tis=True,
        use_rollout_logprobs_as_old=True,
        gamma=0.5,
    )
    with pytest.raises(ConfigError) as err:
        build_algorithm(cfg)
    keys = [p.key for p in err.value.problems]
    assert keys == [
        "algorithm.advantage",
        "algorithm.policy_loss",
        "algorithm.kl_estimator",
        "algorithm.loss_agg",
        "algorithm.use_kl_loss",
        "algorithm.kl_coef",
        "algorithm.dual_clip_c",
        "algorithm.dual_clip_c",
        "algorithm.rollout_correction",
        "algorithm.gamma",
    ]
    text = str(err.value)
    assert "10 problems" in text
    for table in (ADVANTAGE_ESTIMATORS, POLICY_LOSSES, KL_ESTIMATORS, AGGREGATIONS):
        assert ", ".join(table) in text  # unknown names list the valid choices


def test_kl_coef_without_a_kl_term_is_a_problem():
    (p,) = AlgorithmConfig(kl_coef=0.1).problems(prefix="")
    assert p.key == "kl_coef" and "no effect" in p.why


def test_field_ranges_and_unknown_keys_rejected_by_pydantic():
    with pytest.raises(pydantic.ValidationError):
        AlgorithmConfig(eps_clip_low=1.5)
    with pytest.raises(pydantic.ValidationError):
        AlgorithmConfig(kl_coeff=0.1)  # typo: extra="forbid"
    with pytest.raises(pydantic.ValidationError):
        AlgorithmConfig(tis=True, tis_cap=0)


def test_from_toml():
    text = """
    advantage = "rloo"
    policy_loss = "ppo"
    eps_clip_high = 0.28
    loss_agg = "seq_mean_token_mean"
    kl_coef = 0.001
    use_kl_loss = true
    kl_estimator = "k3"
    """
    cfg = AlgorithmConfig.model_validate(tomllib.loads(text))
    algo = build_algorithm(cfg)
    assert algo.loss_agg == "seq_mean_token_mean" and algo.needs_reference


@dataclass(kw_only=True, frozen=True)
class ScaledGrpo:
    """A user's estimator, loaded by import path with its own option: GRPO times a factor."""

    scale: float
    default_loss_agg: ClassVar[str | None] = None

    class Config(AdvantageConfig):
        type: str = "test_algo_config:ScaledGrpo"
        scale: float = pydantic.Field(2.0, gt=0, description="Factor on GRPO's advantage.")

        def build(self) -> ScaledGrpo:
            return ScaledGrpo(scale=self.scale)

    def __call__(self, rewards, mask, kl_penalty):
        return self.scale * Grpo()(rewards, mask, kl_penalty)


def test_an_estimator_from_an_import_path_with_its_own_options():
    cfg = AlgorithmConfig.model_validate(
        tomllib.loads('[advantage]\ntype = "test_algo_config:ScaledGrpo"\nscale = 3.0\n')
    )
    algo = build_algorithm(cfg)
    assert algo.estimator == ScaledGrpo(scale=3.0)
    rewards, mask = torch.tensor([[1.0, 0.0, 0.0, 1.0]]), torch.ones(4, 3)
    grpo = build_algorithm(AlgorithmConfig()).compute_advantages(rewards, mask)
    torch.testing.assert_close(algo.compute_advantages(rewards, mask), 3.0 * grpo)
    with pytest.raises(pydantic.ValidationError, match="scale"):
        AlgorithmConfig(advantage={"type": "test_algo_config:ScaledGrpo", "scale": -1})


def test_flat_keys_of_earlier_configs_load_into_the_variant_tables():
    flat = AlgorithmConfig(normalize_std=False, eps_clip_high=0.28, dual_clip_c=3.0)
    nested = AlgorithmConfig.model_validate(
        {
            "advantage": {"type": "grpo", "normalize_std": False},
            "policy_loss": {"type": "ppo", "eps_clip_high": 0.28, "dual_clip_c": 3.0},
        }
    )
    assert flat == nested and flat.problems() == []
    assert AlgorithmConfig(policy_loss="gspo", gspo_eps_clip_low=1e-3).policy_loss == Gspo.Config(
        eps_clip_low=1e-3
    )
    assert AlgorithmConfig(advantage="reinforce_pp", gamma=0.9).advantage.gamma == 0.9
    # the nested form round-trips through a dump (what `verst train` writes to the run directory)
    assert AlgorithmConfig.model_validate(nested.model_dump()) == nested
    (p,) = AlgorithmConfig(policy_loss={"type": "ppo", "dual_clip_c": 0.5}).problems()
    assert p.key == "algorithm.policy_loss.dual_clip_c" and "> 1" in p.why
