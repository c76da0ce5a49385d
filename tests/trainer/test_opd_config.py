"""Validation of the [opd] section: every combination's problems at once, each with its fix;
the strategy-capability check (a strategy without OPD is refused); TOML round trip."""

from __future__ import annotations

import textwrap

import pytest
from train_testlib import run_dict, write_prompts

from verst.rollout.errors import ConfigError
from verst.rollout.toy import make_tiny_checkpoint
from verst.trainer.config import load_run_config, run_config_from_dict, validate_run_config
from verst.trainer.opd.config import read_vocab_size

STRATEGY_MODULE = '''
from typing import ClassVar
from verst.rollout.protocols import Capability, RolloutResult


class NoOpdStrategy:
    """A custom strategy that cannot serve OPD (its samples are not kept whole)."""

    capabilities: ClassVar[frozenset] = frozenset({Capability.EVAL})

    def __init__(self, context):
        self.context = context

    async def __call__(self, request):
        return RolloutResult()


class SampledOnlyStrategy(NoOpdStrategy):
    capabilities: ClassVar[frozenset] = frozenset({Capability.EVAL, Capability.OPD_SAMPLED_TOKEN})
'''


@pytest.fixture
def base(tmp_path, tiny_checkpoint):
    data = write_prompts(tmp_path / "prompts.jsonl")
    return run_dict(tiny_checkpoint, data)


def problems(data, env=None):
    cfg = run_config_from_dict(data)
    with pytest.raises(ConfigError) as info:
        validate_run_config(cfg, env or {}, cuda_available=False)
    return {p.key: p for p in info.value.problems}


def test_valid_configs_pass(base, tiny_checkpoint):
    t = {"model_path": str(tiny_checkpoint)}
    for opd in (
        {"enabled": True, "teachers": {"a": t}},
        {"enabled": True, "log_prob_top_k": 8, "token_set": "intersection", "teachers": {"a": t}},
        {
            "enabled": True,
            "log_prob_top_k": 8,
            "token_set": "xor",
            "teachers": {"a": {**t, "type": "trainer"}},
        },
        {"enabled": False, "token_set": "nonsense"},  # off: not checked
    ):
        validate_run_config(run_config_from_dict({**base, "opd": opd}), {}, cuda_available=False)


def test_every_problem_at_once_with_fixes(base, tiny_checkpoint):
    vocab = read_vocab_size(str(tiny_checkpoint))
    assert vocab is not None and vocab > 8
    data = {
        **base,
        "opd": {
            "enabled": True,
            "coef": 0.0,
            "with_task_reward": False,
            "log_prob_top_k": vocab + 1,
            "token_set": "onion",
            "weighting": "teacherish",
            "default_teacher": "nobody",
            "teachers": {
                "served": {"engine": {"type": "sglang"}},
                "local": {"type": "trainer"},
                "nopath": {"type": "engine"},
            },
        },
    }
    got = problems(data)
    assert "union" in got["opd.token_set"].fix and "xor" in got["opd.token_set"].fix
    assert "student" in got["opd.weighting"].fix
    assert str(vocab) in got["opd.log_prob_top_k"].why and f"k <= {vocab}" in got["opd.log_prob_top_k"].fix
    assert "first teacher" in got["opd.default_teacher"].fix
    assert "opd.coef" in got and "nothing to train" in got["opd.coef"].why
    assert "urls" in got["opd.teachers.served.engine.urls"].fix
    assert "opd.teachers.local.model_path" in got
    assert "opd.teachers.nopath.model_path" in got


def test_no_teacher(base):
    got = problems({**base, "opd": {"enabled": True}})
    assert "needs a teacher" in got["opd.teachers"].why and "[opd.teachers." in got["opd.teachers"].fix


@pytest.mark.parametrize("token_set", ["only_student", "union", "xor"])
def test_student_side_sets_with_engine_teacher_name_the_fix(base, tiny_checkpoint, token_set):
    opd = {
        "enabled": True,
        "log_prob_top_k": 4,
        "token_set": token_set,
        "teachers": {"big": {"model_path": str(tiny_checkpoint)}},
    }
    p = problems({**base, "opd": opd})["opd.token_set"]
    assert "opd.teachers.big.type = 'trainer'" in p.fix and "intersection" in p.fix


def test_vocab_mismatch_and_fsdp_trainer_teacher(base, tmp_path):
    other = make_tiny_checkpoint(tmp_path / "other", hidden_size=32, num_layers=1)
    import json

    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] += 3
    (other / "config.json").write_text(json.dumps(cfg))
    got = problems(
        {
            **base,
            "train": {**base["train"], "fsdp": True},
            "opd": {"enabled": True, "teachers": {"x": {"type": "trainer", "model_path": str(other)}}},
        },
        env={"WORLD_SIZE": "2"},
    )
    assert "differs from the student's" in got["opd.teachers.x"].why
    assert "engine" in got["opd.teachers.x.type"].fix


def test_strategy_without_opd_capability_is_refused(base, tiny_checkpoint, tmp_path, monkeypatch):
    (tmp_path / "h_opd_strategies.py").write_text(STRATEGY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    teachers = {"a": {"model_path": str(tiny_checkpoint)}}

    def with_strategy(path, **opd):
        return {
            **base,
            "rollout": {**base["rollout"], "rollout_function_path": path},
            "opd": {"enabled": True, "teachers": teachers, **opd},
        }

    p = problems(with_strategy("h_opd_strategies:NoOpdStrategy"))["opd.coef"]
    assert "opd_sampled_token" in p.why and "NoOpdStrategy" in p.why
    p = problems(with_strategy("h_opd_strategies:SampledOnlyStrategy", log_prob_top_k=2))[
        "opd.log_prob_top_k"
    ]
    assert "opd_top_k" in p.why
    cfg = run_config_from_dict(with_strategy("h_opd_strategies:SampledOnlyStrategy"))
    validate_run_config(cfg, {}, cuda_available=False)  # sampled-token OPD is declared: accepted


def test_legacy_strategy_supports_opd(base, tiny_checkpoint):
    pytest.importorskip("verst.rollout_legacy")
    opd = {"enabled": True, "log_prob_top_k": 4, "teachers": {"a": {"model_path": str(tiny_checkpoint)}}}
    cfg = run_config_from_dict({**base, "opd": opd})
    validate_run_config(cfg, {"VERST_USE_LEGACY_ROLLOUT_V1": "1"}, cuda_available=False)


def test_toml_with_overrides(tmp_path, tiny_checkpoint):
    path = tmp_path / "run.toml"
    path.write_text(
        textwrap.dedent(
            f"""
            [opd]
            enabled = true
            log_prob_top_k = 8
            [opd.teachers.big]
            model_path = "{tiny_checkpoint}"
            [opd.teachers.remote]
            engine = {{ type = "sglang", urls = ["http://127.0.0.1:30000"] }}
            """
        )
    )
    cfg = load_run_config(path, ["opd.token_set=intersection", "opd.teachers.big.type=trainer"])
    assert cfg.opd.token_set == "intersection"
    assert cfg.opd.teachers["big"].type == "trainer"
    assert cfg.opd.teachers["remote"].engine.urls == ["http://127.0.0.1:30000"]
    assert cfg.opd.default_teacher_name() == "big"
    with pytest.raises(ConfigError) as info:
        load_run_config(path, ["opd.teachers.big.typo=1"])
    assert info.value.problems[0].key == "opd.teachers.big.typo"
