"""Flat `[algorithm]` keys of earlier configs, moved into the variant tables that own them.

Estimator and loss options live in `[algorithm.advantage]` / `[algorithm.policy_loss]` now (each
variant's own config). Configs written before keep loading: `normalize_std` (grpo) and `gamma`
(reinforce_pp) move into the advantage table, `eps_clip_low` / `eps_clip_high` / `dual_clip_c`
(ppo) and `gspo_eps_clip_low` / `gspo_eps_clip_high` (gspo) into the policy-loss table, and
`tis` / `tis_cap` become `rollout_correction = {type = "tis", cap = tis_cap}`. A flat key
the selected variant does not read is dropped, as it was ignored before — except where that was
reported (a `gamma` other than 1 without reinforce_pp, a `dual_clip_c` without ppo or not above 1),
which stays a problem under the flat key. Unknown variant names are problems too (with the
choices), reported with every other problem by `AlgorithmConfig.problems`, not as a parse error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verst.rollout.errors import Problem
from verst.rollout.importing import ImportPathError
from verst.rollout.variants import VariantTable
from verst.trainer.algorithms.advantages import ADVANTAGES
from verst.trainer.algorithms.policy_losses import POLICY_LOSS_CONFIGS, dual_clip_c_problem
from verst.trainer.algorithms.rollout_correction import ROLLOUT_CORRECTION_CONFIGS

ADVANTAGE_KEYS = {"normalize_std": ("grpo", "normalize_std"), "gamma": ("reinforce_pp", "gamma")}
"""Flat key → (the estimator that reads it, its key in that estimator's table)."""
POLICY_LOSS_KEYS = {
    "eps_clip_low": ("ppo", "eps_clip_low"),
    "eps_clip_high": ("ppo", "eps_clip_high"),
    "dual_clip_c": ("ppo", "dual_clip_c"),
    "gspo_eps_clip_low": ("gspo", "eps_clip_low"),
    "gspo_eps_clip_high": ("gspo", "eps_clip_high"),
}
"""Flat key → (the policy loss that reads it, its key in that loss's table)."""


def migrate_flat_keys(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[Problem]]]:
    """`data` (an `[algorithm]` table) with flat keys moved into the variant tables, and the
    problems found on the way (keys relative to the section), by where they are reported:
    'names' (unknown variants), 'policy_loss', 'advantage'."""
    found: dict[str, list[Problem]] = {
        "names": [],
        "policy_loss": [],
        "advantage": [],
        "rollout_correction": [],
    }
    _migrate_tis(data, found["rollout_correction"])
    if "rollout_correction" in data:  # absent stays absent: fully-async's TIS default reads that
        _variant(data, "rollout_correction", ROLLOUT_CORRECTION_CONFIGS, found["names"])
    adv_name, adv = _variant(data, "advantage", ADVANTAGES, found["names"])
    loss_name, loss = _variant(data, "policy_loss", POLICY_LOSS_CONFIGS, found["names"])
    for key, (owner, field) in ADVANTAGE_KEYS.items():
        if key not in data:
            continue
        value = data.pop(key)
        if adv is not None and adv["type"] == owner:
            adv.setdefault(field, value)
        elif key == "gamma" and value != 1.0:
            found["advantage"].append(
                Problem(
                    "gamma",
                    f"gamma = {value} is only used by advantage = 'reinforce_pp', not {adv_name!r}",
                    "set gamma = 1.0, or advantage = 'reinforce_pp'",
                )
            )
    for key, (owner, field) in POLICY_LOSS_KEYS.items():
        if key not in data:
            continue
        value = data.pop(key)
        ok = True
        if key == "dual_clip_c" and value is not None:
            if isinstance(value, int | float) and value <= 1:
                found["policy_loss"].append(dual_clip_c_problem("dual_clip_c", value))
                ok = False
            if loss_name != "ppo":
                found["policy_loss"].append(
                    Problem(
                        "dual_clip_c",
                        f"dual-clip is implemented by the ppo loss only, not {loss_name!r}",
                        "set dual_clip_c = None, or policy_loss = 'ppo'",
                    )
                )
                ok = False
        if ok and loss is not None and loss["type"] == owner:
            loss.setdefault(field, value)
    return data, found


def _migrate_tis(data: dict[str, Any], problems: list[Problem]) -> None:
    """``tis = true`` (and ``tis_cap``) → ``rollout_correction = {type = "tis", cap = tis_cap}``;
    ``tis = false`` → ``"none"``; a ``tis_cap`` without ``tis`` is dropped (it was ignored). Both
    spellings at once is a problem (which one wins would be a guess)."""
    if "tis" not in data:
        data.pop("tis_cap", None)
        return
    tis = data.pop("tis")
    cap = data.pop("tis_cap", None)
    if "rollout_correction" in data:
        problems.append(
            Problem(
                "tis",
                "tis is the earlier spelling of rollout_correction, and both are set",
                "remove tis / tis_cap and keep rollout_correction (tis = true is "
                "rollout_correction = { type = 'tis', cap = ... })",
            )
        )
        return
    if tis is True:
        data["rollout_correction"] = {"type": "tis", **({} if cap is None else {"cap": cap})}
    elif tis is False:
        data["rollout_correction"] = {"type": "none"}
    else:
        problems.append(Problem("tis", f"tis must be true or false, got {tis!r}", "set tis = true or false"))


def _variant(
    data: dict[str, Any], key: str, table: VariantTable[Any], problems: list[Problem]
) -> tuple[Any, dict[str, Any] | None]:
    """The variant name asked for under `key` and its table (normalised into `data[key]`); an
    unknown name is a problem and falls back to the default variant."""
    value = data.get(key, table.default)
    if isinstance(value, str):
        value = {"type": value}
    if not isinstance(value, Mapping):
        return value, None  # not a table: pydantic reports it
    value = dict(value)
    name = value.setdefault("type", table.default)
    try:
        if not isinstance(name, str):
            raise ValueError(f"{key} type must be a string")
        table.config_class(name)
    except (ValueError, ImportPathError) as exc:
        reason = f"unknown {key} {name!r}" if "unknown" in str(exc) else str(exc)
        problems.append(
            Problem(
                key,
                reason,
                f"use one of: {', '.join(table.builtins)}, or an import path 'package.module:Class'",
            )
        )
        value = {"type": table.default}
    data[key] = value
    return name, value
