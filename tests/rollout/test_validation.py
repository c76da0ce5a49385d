"""Rollout config validation: every problem in one error, each with key and fix; selection checks."""

from __future__ import annotations

import importlib.util
import json
import textwrap

import pytest

from verst.rollout.config import (
    DataConfig,
    EvalConfig,
    EvalDatasetConfig,
    RewardConfig,
    RolloutConfig,
)
from verst.rollout.errors import ConfigError, Problem
from verst.rollout.protocols import Capability
from verst.rollout.selection import LEGACY_FLAG
from verst.rollout.validation import (
    FEATURE_CAPABILITIES,
    FULLY_ASYNC_LEGACY_MESSAGE,
    requested_capabilities,
    validate_rollout_config,
)

STRATEGIES = textwrap.dedent(
    """
    from typing import ClassVar
    from verst.rollout.protocols import Capability

    class EvalOnly:
        capabilities: ClassVar[frozenset[Capability]] = frozenset({Capability.EVAL})

    class Everything:
        capabilities = frozenset(Capability)

    class Undeclared:
        pass

    def v1_rollout(args, rollout_id, data_source, evaluation=False):
        return []
    """
)


@pytest.fixture
def strategies(tmp_path, monkeypatch):
    (tmp_path / "my_strategies.py").write_text(STRATEGIES)
    (tmp_path / "broken_strategy.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_strategies"


def _problems(config: RolloutConfig, env=None, **kw) -> list[Problem]:
    with pytest.raises(ConfigError) as info:
        validate_rollout_config(config, env or {}, **kw)
    err = info.value
    # One error, every problem listed in its message with its fix.
    for p in err.problems:
        assert p.key in str(err) and p.fix in str(err) and p.fix
    return err.problems


def _by_key(problems: list[Problem]) -> dict[str, Problem]:
    return {p.key: p for p in problems}


def test_default_config_is_valid():
    validate_rollout_config(RolloutConfig(), {})


def test_default_config_with_legacy_installed_is_valid():
    validate_rollout_config(RolloutConfig(), {LEGACY_FLAG: "1"})


def test_every_cross_field_problem_in_one_error(tmp_path, strategies):
    bad_data = tmp_path / "prompts.csv"
    bad_data.write_text("x")
    config = RolloutConfig(
        rollout_function_path=f"{strategies}:Everything",
        batch_size=8,
        over_sampling_batch_size=4,
        n_samples_per_prompt=1,
        top_k=0,
        max_response_len=256,
        max_context_len=128,
        dynamic_filters=["nonzero_std", "no_such_filter"],
        mask_offpolicy_in_partial_rollout=True,
        fully_async=True,
        max_weight_staleness=0,
        async_buffer_groups=4,
        generate_function_path="not_a_path:",
        data=DataConfig(path=str(bad_data)),
        reward=RewardConfig(type="remote", key="acc"),
        eval=EvalConfig(
            temperature=0,
            max_response_len=200,
            datasets={"gsm": EvalDatasetConfig(path=str(tmp_path / "missing.jsonl"), n_samples_per_prompt=4)},
        ),
    )
    problems = _by_key(_problems(config))
    expected = {
        "rollout.over_sampling_batch_size": "smaller than rollout.batch_size",
        "rollout.top_k": "not a valid setting",
        "rollout.max_context_len": "no room for the prompt",
        "rollout.eval.max_response_len": "no room for the prompt",
        "rollout.eval.datasets.gsm.n_samples_per_prompt": "identical copies",
        "rollout.eval.datasets.gsm.path": "does not exist",
        "rollout.reward.url": "needs the URL",
        "rollout.dynamic_filters[1]": "unknown dynamic filter 'no_such_filter'",
        "rollout.dynamic_filters": "nonzero_std drops every group",
        "rollout.mask_offpolicy_in_partial_rollout": "partial_rollout is off",
        "rollout.strategy_options.async_buffer_groups": "cannot hold one batch",
        "rollout.generate_function_path": "not an import path",
        "rollout.data.path": "unknown file type '.csv'",
    }
    for key, why in expected.items():
        assert key in problems, f"missing problem for {key}; got {sorted(problems)}"
        assert why in problems[key].why, (key, problems[key].why)
    assert "nonzero_std" in problems["rollout.dynamic_filters[1]"].fix  # lists the valid filters
    assert "no_aborted" in problems["rollout.dynamic_filters[1]"].fix


def test_reward_problems(strategies):
    problems = _by_key(_problems(RolloutConfig(reward=RewardConfig(type="exact", url="http://x"))))
    assert "unknown reward 'exact'" in problems["rollout.reward.type"].why
    assert "exact_match" in problems["rollout.reward.type"].fix
    assert "would be ignored" in problems["rollout.reward.url"].why
    problems = _by_key(_problems(RolloutConfig(reward=RewardConfig(type="math", key="acc"))))
    assert "returns a float" in problems["rollout.reward.key"].why


def test_fully_async_with_legacy_flag_exact_message():
    config = RolloutConfig(fully_async=True)
    (problem,) = _problems(config, {LEGACY_FLAG: "1"})
    assert problem.why == FULLY_ASYNC_LEGACY_MESSAGE
    assert problem.why == "--fully-async needs the class-based rollout API; unset VERST_USE_LEGACY_ROLLOUT_V1"


def test_legacy_flag_without_the_package(strategies):
    def find_spec(name):
        return None if name == "verst.rollout_legacy" else importlib.util.find_spec(name)

    (problem,) = _problems(RolloutConfig(), {LEGACY_FLAG: "true"}, find_spec=find_spec)
    assert problem.key == LEGACY_FLAG
    assert "verst-rollout-legacy is not installed" in problem.why
    assert "uv sync --extra legacy" in problem.fix and "pip install verst[legacy]" in problem.fix


def test_legacy_flag_without_the_package_via_meta_path(monkeypatch):
    """The default find_spec, with the package made unfindable by a meta-path hook."""
    import sys

    class HideLegacy:
        def find_spec(self, name, path=None, target=None):
            if name == "verst.rollout_legacy" or name.startswith("verst.rollout_legacy."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    for mod in [m for m in sys.modules if m.startswith("verst.rollout_legacy")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(sys, "meta_path", [HideLegacy(), *sys.meta_path])
    (problem,) = _problems(RolloutConfig(), {LEGACY_FLAG: "1"})
    assert "uv sync --extra legacy" in problem.fix


def test_malformed_flag_is_a_problem_with_others():
    problems = _by_key(_problems(RolloutConfig(top_k=0), {LEGACY_FLAG: "yes"}))
    assert set(problems) == {LEGACY_FLAG, "rollout.top_k"}
    assert "'yes' is not a valid value" in problems[LEGACY_FLAG].why
    assert "['0', '1', 'false', 'true']" in problems[LEGACY_FLAG].fix


def test_capabilities_checked_against_selected_strategy(strategies):
    config = RolloutConfig(
        rollout_function_path=f"{strategies}:EvalOnly",
        partial_rollout=True,
        dynamic_filters=["no_aborted"],
        reward=RewardConfig(group=True),
        generate_function_path=f"{strategies}:v1_rollout",
    )
    problems = _by_key(_problems(config, extra_requests={Capability.OPD_TOP_K: "trainer.opd.log_prob_top_k"}))
    assert set(problems) == {
        "rollout.partial_rollout",
        "rollout.dynamic_filters",
        "rollout.reward.group",
        "rollout.generate_function_path",
        "trainer.opd.log_prob_top_k",
    }
    assert (
        "does not support partial_rollout (it supports: ['eval'])" in problems["rollout.partial_rollout"].why
    )
    assert "opd_top_k" in problems["trainer.opd.log_prob_top_k"].fix


def test_extra_problems_join_the_same_error():
    extra = [Problem("trainer.lr", "negative", "use a positive learning rate")]
    (problem,) = _problems(RolloutConfig(), extra=extra)
    assert problem == extra[0]


def test_default_strategy_refuses_nothing_it_supports(strategies):
    config = RolloutConfig(
        partial_rollout=True,
        mask_offpolicy_in_partial_rollout=True,
        dynamic_filters=["nonzero_std"],
        over_sampling_batch_size=16,
        reward=RewardConfig(group=True, type=f"{strategies}:Everything"),
    )
    validate_rollout_config(config, {})


def test_legacy_strategy_refuses_what_it_lacks_but_not_fully_async_twice():
    # The legacy strategy is selected by the flag; a custom capability request it lacks is reported.
    config = RolloutConfig(partial_rollout=True)
    validate_rollout_config(config, {LEGACY_FLAG: "1"})
    (problem,) = _problems(config, {LEGACY_FLAG: "1"}, extra_requests={Capability.FULLY_ASYNC: "x.async"})
    assert problem.key == "x.async" and "LegacyRolloutStrategy" in problem.why


def test_unloadable_or_undeclared_strategy(strategies):
    (p,) = _problems(RolloutConfig(rollout_function_path="no_such_pkg.mod:S"))
    assert p.key == "rollout.rollout_function_path" and "is not installed" in p.why
    (p,) = _problems(RolloutConfig(rollout_function_path="broken_strategy:S"))
    assert "fails on import: RuntimeError: boom at import" in p.why
    (p,) = _problems(RolloutConfig(rollout_function_path=f"{strategies}:Undeclared"))
    assert "declares no `capabilities`" in p.why


def test_v1_rollout_function_uses_adapter_capabilities(strategies):
    path = f"{strategies}:v1_rollout"
    validate_rollout_config(RolloutConfig(rollout_function_path=path), {})
    problems = _by_key(_problems(RolloutConfig(rollout_function_path=path, fully_async=True)))
    assert "does not support fully_async" in problems["rollout.fully_async"].why


def test_user_modules_must_exist(strategies):
    config = RolloutConfig(
        generate_function_path="no_such_module.gen:fn",
        reward=RewardConfig(type="no_such_rewards:fn"),
        dynamic_filters=["no_aborted", f"{strategies}:Everything", "verst.no_such:f"],
    )
    problems = _by_key(_problems(config))
    assert set(problems) == {
        "rollout.generate_function_path",
        "rollout.reward.type",
        "rollout.dynamic_filters[2]",
    }
    assert "module 'no_such_module.gen' is not installed" in problems["rollout.generate_function_path"].why
    assert "'no_such_rewards' is not installed" in problems["rollout.reward.type"].why


def test_requested_capabilities_table():
    assert requested_capabilities(RolloutConfig()) == {}
    config = RolloutConfig(fully_async=True, eval=EvalConfig(datasets={"a": EvalDatasetConfig(path="x")}))
    assert requested_capabilities(config) == {
        Capability.FULLY_ASYNC: "rollout.fully_async",
        Capability.EVAL: "rollout.eval.datasets",
    }
    assert len({f.capability for f in FEATURE_CAPABILITIES}) == len(FEATURE_CAPABILITIES)


def test_valid_data_files_pass(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a"}) + "\n")
    config = RolloutConfig(
        data=DataConfig(path=str(path)),
        eval=EvalConfig(datasets={"held_out": EvalDatasetConfig(path=str(path))}),
    )
    validate_rollout_config(config, {})
