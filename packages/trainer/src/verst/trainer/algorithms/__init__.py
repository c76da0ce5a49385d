"""RL algorithms: advantage estimators, policy losses, loss aggregation, KL estimators.

Pure torch, no model code. `AlgorithmConfig` is the ``[algorithm]`` config section;
`build_algorithm` builds the estimator and the policy loss from their own configs
(`[algorithm.advantage]`, `[algorithm.policy_loss]`: tables `ADVANTAGES`, `POLICY_LOSS_CONFIGS`),
picks aggregation and KL estimator by name (`AGGREGATIONS`, `KL_ESTIMATORS`) and returns an `Algorithm` with `compute_advantages` and `loss`.
See docs/algorithms.md for the formulas.
"""

from verst.trainer.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGES,
    AdvantageConfig,
    AdvantageEstimator,
    DrGrpo,
    Grpo,
    ReinforcePP,
    ReinforcePPBaseline,
    Rloo,
)
from verst.trainer.algorithms.aggregation import AGGREGATIONS, Aggregation, LossNorm
from verst.trainer.algorithms.algorithm import Algorithm, LossOutput, build_algorithm
from verst.trainer.algorithms.config import AlgorithmConfig
from verst.trainer.algorithms.kl import KL_ESTIMATORS, KlEstimator
from verst.trainer.algorithms.policy_losses import (
    POLICY_LOSS_CONFIGS,
    POLICY_LOSSES,
    Gspo,
    PolicyLoss,
    PolicyLossConfig,
    PolicyLossTerms,
    PpoClip,
)

__all__ = [
    "ADVANTAGES",
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "POLICY_LOSS_CONFIGS",
    "AdvantageConfig",
    "AdvantageEstimator",
    "Aggregation",
    "Algorithm",
    "AlgorithmConfig",
    "DrGrpo",
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
    "build_algorithm",
]
