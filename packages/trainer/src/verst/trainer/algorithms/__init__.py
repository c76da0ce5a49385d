"""RL algorithms: advantage estimators, policy losses, loss aggregation, KL estimators.

Pure torch, no model code. `AlgorithmConfig` is the ``[algorithm]`` config section;
`build_algorithm` builds the estimator and the policy loss from their own configs
(`[algorithm.advantage]`, `[algorithm.policy_loss]`, `[algorithm.rollout_correction]`: tables
`ADVANTAGES`, `POLICY_LOSS_CONFIGS`, `ROLLOUT_CORRECTION_CONFIGS`),
picks aggregation and KL estimator by name (`AGGREGATIONS`, `KL_ESTIMATORS`) and returns an `Algorithm` with `compute_advantages` and `loss`.
See docs/algorithms.md for the formulas.
"""

from verst.trainer.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGES,
    AdvantageConfig,
    AdvantageEstimator,
    DrGrpo,
    Gae,
    Grpo,
    ReinforcePP,
    ReinforcePPBaseline,
    Rloo,
)
from verst.trainer.algorithms.aggregation import AGGREGATIONS, Aggregation, LossNorm
from verst.trainer.algorithms.algorithm import Algorithm, LossOutput, build_algorithm
from verst.trainer.algorithms.config import AlgorithmConfig
from verst.trainer.algorithms.critic_config import CriticConfig
from verst.trainer.algorithms.kl import KL_ESTIMATORS, KlEstimator
from verst.trainer.algorithms.policy_losses import (
    POLICY_LOSS_CONFIGS,
    POLICY_LOSSES,
    Cispo,
    Gspo,
    PolicyLoss,
    PolicyLossConfig,
    PolicyLossTerms,
    PpoClip,
)
from verst.trainer.algorithms.rollout_correction import (
    ROLLOUT_CORRECTION_CONFIGS,
    ROLLOUT_CORRECTIONS,
    RolloutCorrection,
    RolloutCorrectionConfig,
)

__all__ = [
    "ADVANTAGES",
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "POLICY_LOSS_CONFIGS",
    "ROLLOUT_CORRECTIONS",
    "ROLLOUT_CORRECTION_CONFIGS",
    "AdvantageConfig",
    "AdvantageEstimator",
    "Aggregation",
    "Algorithm",
    "AlgorithmConfig",
    "Cispo",
    "CriticConfig",
    "DrGrpo",
    "Gae",
    "Grpo",
    "Gspo",
    "KlEstimator",
    "LossNorm",
    "LossOutput",
    "PolicyLoss",
    "PolicyLossConfig",
    "PolicyLossTerms",
    "PpoClip",
    "ReinforcePP",
    "ReinforcePPBaseline",
    "Rloo",
    "RolloutCorrection",
    "RolloutCorrectionConfig",
    "build_algorithm",
]
