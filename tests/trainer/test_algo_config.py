"""AlgorithmConfig: every problem reported at once, tables drive the choices, TOML round trip."""

from __future__ import annotations

import tomllib

import pydantic
import pytest

from verst.rollout.errors import ConfigError
from verst.trainer.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AlgorithmConfig,
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
    algo = build_algorithm(
        AlgorithmConfig(advantage=adv, policy_loss=loss, kl_estimator=kl, kl_coef=0.01, use_kl_loss=True)
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
        "algorithm.tis",
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
        AlgorithmConfig(tis_cap=0)


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
