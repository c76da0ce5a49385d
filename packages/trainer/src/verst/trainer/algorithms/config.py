"""The ``[algorithm]`` section: advantage estimator, policy loss, aggregation, KL, entropy,
rollout correction.

The estimator, the policy loss and the rollout correction own their options:
`[algorithm.advantage]`, `[algorithm.policy_loss]` and `[algorithm.rollout_correction]` are each
variant's config, chosen by `type` (a plain name works too;
flat keys of earlier configs are migrated, see `migration`). Aggregation and the KL estimator are
chosen by name from their tables. `AlgorithmConfig.problems` reports every
cross-field problem at once; `AlgorithmConfig.check` raises them as one `ConfigError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import Field, ModelWrapValidatorHandler, PrivateAttr, model_validator

from verst.rollout.config import Section
from verst.rollout.errors import ConfigError, Problem
from verst.trainer.algorithms.advantages import ADVANTAGES
from verst.trainer.algorithms.aggregation import AGGREGATIONS
from verst.trainer.algorithms.critic_config import CriticConfig
from verst.trainer.algorithms.kl import KL_ESTIMATORS
from verst.trainer.algorithms.migration import migrate_flat_keys
from verst.trainer.algorithms.policy_losses import POLICY_LOSS_CONFIGS
from verst.trainer.algorithms.rollout_correction import ROLLOUT_CORRECTION_CONFIGS


class AlgorithmConfig(Section):
    """How rewards become advantages and advantages become a loss."""

    advantage: ADVANTAGES.field = Field(  # type: ignore[valid-type]
        default_factory=ADVANTAGES.build_default,
        description=(
            "Advantage estimator: a name (grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, gae, grpo_per_turn, "
            "or 'pkg.module:Estimator') or a table with `type` and the estimator's own options."
        ),
    )
    policy_loss: POLICY_LOSS_CONFIGS.field = Field(  # type: ignore[valid-type]
        default_factory=POLICY_LOSS_CONFIGS.build_default,
        description=(
            "Policy loss: a name (ppo: clipped, clip-higher, dual-clip; gspo; or 'pkg.module:Loss') "
            "or a table with `type` and the loss's own options."
        ),
    )
    loss_agg: str | None = Field(
        None,
        description=(
            "Loss aggregation: token_mean, seq_mean_token_mean, seq_mean_token_sum_norm. None = the "
            "policy loss's default (gspo: seq_mean_token_mean), else the estimator's (dr_grpo: "
            "seq_mean_token_sum_norm), else token_mean."
        ),
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL to the frozen reference model.")
    kl_estimator: str = Field("low_var", description="KL estimator: k1, k2, k3, low_var.")
    use_kl_loss: bool = Field(False, description="Add kl_coef * KL as a loss term (GRPO-style).")
    use_kl_in_reward: bool = Field(
        False, description="Subtract kl_coef * KL from the per-token reward (PPO/REINFORCE++-style)."
    )
    entropy_coef: float = Field(
        0.0, description="Entropy bonus: the loss gets -entropy_coef * aggregated entropy."
    )
    rollout_correction: ROLLOUT_CORRECTION_CONFIGS.field = Field(  # type: ignore[valid-type]
        default_factory=ROLLOUT_CORRECTION_CONFIGS.build_default,
        description=(
            "Engine/trainer mismatch correction of the policy loss: a name (none, tis, seq_tis, "
            "mis_token, mis_seq, icepop) or a table with `type` and its options. The flat "
            "`tis = true` / `tis_cap` of earlier configs mean {type = 'tis', cap = tis_cap}."
        ),
    )
    critic: CriticConfig | None = Field(
        None,
        description="The value model of PPO with GAE ([algorithm.critic]; needs advantage = 'gae'). "
        "None = no critic.",
    )
    use_rollout_logprobs_as_old: bool = Field(
        False, description="Use the engine's rollout log-probs as the old policy (skips recomputing them)."
    )

    _deferred: dict[str, list[Problem]] = PrivateAttr(default_factory=dict)
    """Problems found while reading the section (unknown variants, misplaced flat keys)."""

    @model_validator(mode="wrap")
    @classmethod
    def _migrate(cls, data: Any, handler: ModelWrapValidatorHandler[AlgorithmConfig]) -> AlgorithmConfig:
        """Flat keys of earlier configs move into the variant tables (`migration`)."""
        if not isinstance(data, Mapping):
            return handler(data)
        data, deferred = migrate_flat_keys(dict(data))
        config = handler(data)
        config._deferred = deferred
        return config

    @property
    def tis(self) -> bool:
        """Token-level TIS is the rollout correction (the flag of earlier configs, read-only)."""
        return self.rollout_correction.type == "tis"

    def resolved_loss_agg(self) -> str:
        """`loss_agg`, or the default of the selected policy loss / estimator when it is None."""
        if self.loss_agg is not None:
            return self.loss_agg
        for part in (self.policy_loss.build(), self.advantage.build()):
            if part.default_loss_agg is not None:
                return part.default_loss_agg
        return "token_mean"

    def problems(self, prefix: str = "algorithm") -> list[Problem]:
        """Every cross-field problem, each with its fix (empty = valid)."""
        out: list[Problem] = []

        def key(name: str) -> str:
            return f"{prefix}.{name}" if prefix else name

        def deferred(where: str) -> list[Problem]:
            return [Problem(key(p.key), p.why, p.fix) for p in self._deferred.get(where, [])]

        out += deferred("names")
        for name, value, table in (
            ("kl_estimator", self.kl_estimator, KL_ESTIMATORS),
            ("loss_agg", self.loss_agg, AGGREGATIONS),
        ):
            if value is not None and value not in table:
                out.append(Problem(key(name), f"unknown {name} {value!r}", f"use one of: {', '.join(table)}"))
        if self.use_kl_loss and self.use_kl_in_reward:
            out.append(
                Problem(
                    key("use_kl_loss"),
                    "use_kl_loss and use_kl_in_reward are both on: the KL would be penalised twice",
                    "keep one: use_kl_loss (GRPO-style) or use_kl_in_reward (REINFORCE++/PPO-style)",
                )
            )
        if self.kl_coef > 0 and not (self.use_kl_loss or self.use_kl_in_reward):
            out.append(
                Problem(
                    key("kl_coef"),
                    f"kl_coef = {self.kl_coef} but neither use_kl_loss nor use_kl_in_reward is on: it has no effect",
                    "set use_kl_loss = true or use_kl_in_reward = true, or kl_coef = 0",
                )
            )
        if self.kl_coef == 0 and (self.use_kl_loss or self.use_kl_in_reward):
            flag = "use_kl_loss" if self.use_kl_loss else "use_kl_in_reward"
            out.append(
                Problem(
                    key("kl_coef"),
                    f"{flag} is on but kl_coef = 0: the KL term has no effect",
                    f"set kl_coef > 0 (e.g. 0.001), or {flag} = false",
                )
            )
        out += self.policy_loss.problems(key("policy_loss")) + deferred("policy_loss")
        rc = self.rollout_correction
        out += rc.problems(key("rollout_correction")) + deferred("rollout_correction")
        if rc.active and self.use_rollout_logprobs_as_old:
            out.append(
                Problem(
                    key("rollout_correction"),
                    f"rollout_correction {rc.type!r} with use_rollout_logprobs_as_old: old == rollout "
                    "log-probs, so every ratio is 1 and the correction does nothing",
                    "set rollout_correction = 'none', or use_rollout_logprobs_as_old = false (the "
                    "correction needs recomputed old log-probs)",
                )
            )
        out += self.advantage.problems(key("advantage")) + deferred("advantage")
        out += self._critic_problems(key)
        return out

    def _critic_problems(self, key: Callable[[str], str]) -> list[Problem]:
        """A critic needs an estimator that reads values, and such an estimator needs a critic."""
        needs_values = bool(getattr(self.advantage.build(), "needs_values", False))
        if self.critic is not None and not needs_values:
            return [
                Problem(
                    key("critic"),
                    f"[algorithm.critic] is set but the estimator {self.advantage.type!r} ignores values: "
                    "the critic would be trained for nothing",
                    "set advantage = 'gae' (PPO with a value model), or remove [algorithm.critic]",
                )
            ]
        if self.critic is None and needs_values:
            return [
                Problem(
                    key("advantage"),
                    f"the estimator {self.advantage.type!r} needs a value model, and there is no critic",
                    "add an [algorithm.critic] table (e.g. lr = 1e-5), or pick an estimator without "
                    "values (grpo, rloo, ...)",
                )
            ]
        return []

    def check(self, prefix: str = "algorithm") -> None:
        """Raise one `ConfigError` listing every problem, if any."""
        problems = self.problems(prefix)
        if problems:
            raise ConfigError(problems)
