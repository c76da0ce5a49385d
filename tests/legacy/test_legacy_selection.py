"""Selecting the legacy strategy: it loads, validates, and fails with the install hint when absent.

Absence is simulated with a meta-path finder that refuses `verst.rollout_legacy` (as an
environment without the `legacy` extra would), not by uninstalling anything.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys

import pytest
from legacy_testkit import HoldingEngine, legacy_context, write_prompts

from verst.rollout.config import EvalConfig, EvalDatasetConfig, RewardConfig
from verst.rollout.errors import ConfigError
from verst.rollout.importing import ImportPathError
from verst.rollout.loading import load_rollout_strategy
from verst.rollout.protocols import Capability, RolloutStrategy
from verst.rollout.selection import (
    LEGACY_FLAG,
    LEGACY_STRATEGY_PATH,
    resolve_extra_env_vars,
    resolve_strategy_path,
)
from verst.rollout.validation import validate_rollout_config
from verst.rollout_legacy import LegacyRolloutStrategy


class _RefuseLegacy(importlib.abc.MetaPathFinder):
    """Makes `verst.rollout_legacy` (and its submodules) not installed for this process."""

    def find_spec(self, name, path=None, target=None):
        if name == "verst.rollout_legacy" or name.startswith("verst.rollout_legacy."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


@pytest.fixture
def legacy_absent(monkeypatch):
    for name in [
        n for n in sys.modules if n == "verst.rollout_legacy" or n.startswith("verst.rollout_legacy.")
    ]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_RefuseLegacy(), *sys.meta_path])
    importlib.invalidate_caches()


def test_flag_selects_and_loads_the_legacy_strategy(tmp_path):
    env = resolve_extra_env_vars({LEGACY_FLAG: "1"}, environ={})
    ctx = legacy_context(tmp_path, HoldingEngine(), ["a", "b"], env=env)
    assert resolve_strategy_path(ctx.config, env) == LEGACY_STRATEGY_PATH
    strategy = load_rollout_strategy(LEGACY_STRATEGY_PATH, ctx)
    assert isinstance(strategy, LegacyRolloutStrategy)
    assert isinstance(strategy, RolloutStrategy)
    assert Capability.FULLY_ASYNC not in strategy.capabilities
    validate_rollout_config(ctx.config, env)


def test_every_feature_the_legacy_path_declares_passes_validation(tmp_path):
    eval_file = write_prompts(tmp_path / "eval.jsonl", ["x"])
    ctx = legacy_context(
        tmp_path,
        HoldingEngine(),
        ["a", "b"],
        over_sampling_batch_size=4,
        partial_rollout=True,
        mask_offpolicy_in_partial_rollout=True,
        dynamic_filters=["nonzero_std", "no_aborted"],
        reward=RewardConfig(group=True, type="legacy_v1_functions:group_reward"),
        generate_function_path="legacy_v1_functions:v1_generate",
        eval=EvalConfig(datasets={"x": EvalDatasetConfig(path=str(eval_file))}),
    )
    validate_rollout_config(
        ctx.config,
        {LEGACY_FLAG: "1"},
        extra_requests={Capability.OPD_TOP_K: "trainer.opd.log_prob_top_k"},
    )


def test_fully_async_with_the_flag_fails_fast(tmp_path):
    ctx = legacy_context(tmp_path, HoldingEngine(), ["a"], fully_async=True)
    with pytest.raises(ConfigError) as info:
        validate_rollout_config(ctx.config, {LEGACY_FLAG: "1"})
    assert "--fully-async needs the class-based rollout API; unset VERST_USE_LEGACY_ROLLOUT_V1" in str(
        info.value
    )


def test_flag_without_the_package_fails_with_the_install_hint(tmp_path, legacy_absent):
    ctx = legacy_context(tmp_path, HoldingEngine(), ["a"])
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("verst.rollout_legacy")
    with pytest.raises(ConfigError) as info:
        validate_rollout_config(ctx.config, {LEGACY_FLAG: "1"})
    message = str(info.value)
    assert "verst-rollout-legacy is not installed" in message
    assert "uv sync --extra legacy" in message
    assert len(info.value.problems) == 1
    # The default path does not need the package at all.
    validate_rollout_config(ctx.config, {LEGACY_FLAG: "0"})
    validate_rollout_config(ctx.config, {})
    # Loading it anyway says "not installed", not "broken on import".
    with pytest.raises(ImportPathError, match="is not installed"):
        load_rollout_strategy(LEGACY_STRATEGY_PATH, ctx)


def test_malformed_flag_is_one_problem(tmp_path):
    ctx = legacy_context(tmp_path, HoldingEngine(), ["a"])
    with pytest.raises(ConfigError) as info:
        validate_rollout_config(ctx.config, {LEGACY_FLAG: "yes"})
    assert len(info.value.problems) == 1 and "'yes' is not a valid value" in str(info.value)


def test_legacy_extra_brings_the_package_into_the_main_environment():
    """`uv sync --extra legacy`: the root `legacy` extra names the workspace package, and the
    lock resolves it to the editable `packages/rollout-legacy`, which needs rollout-core only."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["legacy"] == ["verst-rollout-legacy"]
    assert pyproject["tool"]["uv"]["sources"]["verst-rollout-legacy"] == {"workspace": True}
    legacy = tomllib.loads((root / "packages/rollout-legacy/pyproject.toml").read_text())
    assert legacy["project"]["dependencies"] == ["verst-rollout-core"]
    lock = tomllib.loads((root / "uv.lock").read_text())
    by_name = {p["name"]: p for p in lock["package"]}
    assert by_name["verst-rollout-legacy"]["source"] == {"editable": "packages/rollout-legacy"}
    assert {d["name"] for d in by_name["verst-rollout-legacy"].get("dependencies", [])} == {
        "verst-rollout-core"
    }
    assert any(
        d["name"] == "verst-rollout-legacy" for d in by_name["verst"]["optional-dependencies"]["legacy"]
    )
