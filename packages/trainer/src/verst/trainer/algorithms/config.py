"""The ``[algorithm]`` section: advantage estimator, policy loss, aggregation, KL, entropy, TIS.

Each pluggable part (estimator, loss, aggregation, KL estimator) is chosen by name from one table
and built from the fields it reads (its ``from_config``). `AlgorithmConfig.problems` reports every
cross-field problem at once; `AlgorithmConfig.check` raises them as one `ConfigError`.
"""

from __future__ import annotations

from pydantic import Field

from verst.rollout.config import Section
from verst.rollout.errors import ConfigError, Problem
from verst.trainer.algorithms.advantages import ADVANTAGE_ESTIMATORS
from verst.trainer.algorithms.aggregation import AGGREGATIONS
from verst.trainer.algorithms.kl import KL_ESTIMATORS
from verst.trainer.algorithms.policy_losses import POLICY_LOSSES


class AlgorithmConfig(Section):
    """How rewards become advantages and advantages become a loss."""

    advantage: str = Field(
        "grpo",
        description="Advantage estimator: grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline.",
    )
    normalize_std: bool = Field(
        True, description="GRPO: divide the group-centred reward by the group std (+1e-6)."
    )
    gamma: float = Field(1.0, gt=0, le=1, description="REINFORCE++: discount of the per-token return-to-go.")
    policy_loss: str = Field("ppo", description="Policy loss: ppo (clipped, clip-higher, dual-clip) or gspo.")
    eps_clip_low: float = Field(
        0.2, ge=0, lt=1, description="PPO: the ratio is clipped below at 1 - eps_clip_low."
    )
    eps_clip_high: float = Field(
        0.2,
        ge=0,
        description="PPO: the ratio is clipped above at 1 + eps_clip_high (clip-higher, e.g. 0.28).",
    )
    dual_clip_c: float | None = Field(
        None,
        description="PPO dual-clip: for A < 0 the per-token loss is capped at c*|A| (c > 1; None = off).",
    )
    gspo_eps_clip_low: float = Field(
        3e-4, ge=0, lt=1, description="GSPO: lower clip of the sequence-level ratio (paper: 3e-4)."
    )
    gspo_eps_clip_high: float = Field(
        4e-4, ge=0, description="GSPO: upper clip of the sequence-level ratio (paper: 4e-4)."
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
    tis: bool = Field(
        False,
        description="Truncated importance sampling: weight each token's policy loss by "
        "min(exp(old - rollout log-prob), tis_cap), correcting trainer/engine mismatch.",
    )
    tis_cap: float = Field(2.0, gt=0, description="Truncation cap of the TIS weight.")
    use_rollout_logprobs_as_old: bool = Field(
        False, description="Use the engine's rollout log-probs as the old policy (skips recomputing them)."
    )

    def resolved_loss_agg(self) -> str:
        """`loss_agg`, or the default of the selected policy loss / estimator when it is None."""
        if self.loss_agg is not None:
            return self.loss_agg
        for table, name in ((POLICY_LOSSES, self.policy_loss), (ADVANTAGE_ESTIMATORS, self.advantage)):
            cls = table.get(name)
            if cls is not None and cls.default_loss_agg is not None:
                return cls.default_loss_agg
        return "token_mean"

    def problems(self, prefix: str = "algorithm") -> list[Problem]:
        """Every cross-field problem, each with its fix (empty = valid)."""
        out: list[Problem] = []

        def key(name: str) -> str:
            return f"{prefix}.{name}" if prefix else name

        for name, value, table in (
            ("advantage", self.advantage, ADVANTAGE_ESTIMATORS),
            ("policy_loss", self.policy_loss, POLICY_LOSSES),
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
        if self.dual_clip_c is not None:
            if self.dual_clip_c <= 1:
                out.append(
                    Problem(
                        key("dual_clip_c"),
                        f"dual_clip_c = {self.dual_clip_c} must be > 1 (the cap c*|A| must lie above the clipped loss)",
                        "set dual_clip_c = 3.0 (a common value), or None to turn dual-clip off",
                    )
                )
            if self.policy_loss != "ppo":
                out.append(
                    Problem(
                        key("dual_clip_c"),
                        f"dual-clip is implemented by the ppo loss only, not {self.policy_loss!r}",
                        "set dual_clip_c = None, or policy_loss = 'ppo'",
                    )
                )
        if self.tis and self.use_rollout_logprobs_as_old:
            out.append(
                Problem(
                    key("tis"),
                    "tis with use_rollout_logprobs_as_old: old == rollout log-probs, so every TIS weight is 1",
                    "turn one off (tis corrects trainer/engine mismatch when old log-probs are recomputed)",
                )
            )
        if self.gamma != 1.0 and self.advantage != "reinforce_pp":
            out.append(
                Problem(
                    key("gamma"),
                    f"gamma = {self.gamma} is only used by advantage = 'reinforce_pp', not {self.advantage!r}",
                    "set gamma = 1.0, or advantage = 'reinforce_pp'",
                )
            )
        return out

    def check(self, prefix: str = "algorithm") -> None:
        """Raise one `ConfigError` listing every problem, if any."""
        problems = self.problems(prefix)
        if problems:
            raise ConfigError(problems)
