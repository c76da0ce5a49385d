"""Run config: TOML + overrides, pydantic errors as Problems, one ConfigError for everything."""

from __future__ import annotations

import pytest

from verst.rollout.errors import ConfigError
from verst.trainer.config import (
    RunConfig,
    TrainConfig,
    load_run_config,
    parse_override,
    train_problems,
    validate_run_config,
)

TOML = """
[run]
num_steps = 5
[train]
model_path = "/m"
lr = 1e-4
[rollout]
batch_size = 4
n_samples_per_prompt = 2
[rollout.data]
path = "prompts.jsonl"
[algorithm]
advantage = "rloo"
"""


def test_load_toml_with_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(TOML)
    cfg = load_run_config(
        path, ["train.lr=3e-5", "run.name=hello world", 'rollout.stop=["\\n"]', "train.fsdp=true"]
    )
    assert cfg.train.lr == 3e-5
    assert cfg.run.name == "hello world"  # not TOML: kept as a string
    assert cfg.rollout.stop == ["\n"]
    assert cfg.train.fsdp is True
    assert cfg.algorithm.advantage.type == "rloo"
    assert cfg.run.num_steps == 5


def test_parse_override_types():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a=true") == (["a"], True)
    assert parse_override("a=some/path") == (["a"], "some/path")
    with pytest.raises(ConfigError):
        parse_override("novalue")


def test_every_field_is_documented():
    for model in (TrainConfig, RunConfig):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_unknown_keys_and_bad_values_reported_together(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(TOML + "\n[train2]\nx = 1\n")
    with pytest.raises(ConfigError) as info:
        load_run_config(path, ["train.learning_rat=1", "train.lr=-1", "rollout.batch_sise=2"])
    problems = {p.key: p for p in info.value.problems}
    assert "train.learning_rat" in problems and "train.lr" in problems and "train2" in problems
    assert "rollout.batch_sise" in problems
    assert "rollout.batch_size" in problems["rollout.batch_sise"].fix  # closest valid key
    assert "greater than 0" in problems["train.lr"].why


def test_validate_collects_trainer_algorithm_and_rollout_problems():
    cfg = RunConfig.model_validate(
        {
            "train": {"model_path": "/m", "fsdp": True, "num_updates_per_rollout": 3},
            "rollout": {"batch_size": 2, "n_samples_per_prompt": 2, "data": {"path": "/nonexistent.jsonl"}},
            "algorithm": {"use_kl_loss": True, "use_kl_in_reward": True, "kl_coef": 0.1},
        }
    )
    with pytest.raises(ConfigError) as info:
        validate_run_config(cfg, {}, cuda_available=False)
    keys = [p.key for p in info.value.problems]
    assert "train.fsdp" in keys  # FSDP on CPU with one process
    assert "train.num_updates_per_rollout" in keys
    assert any(k.startswith("algorithm.") for k in keys)
    assert any(k.startswith("rollout.data") for k in keys)
    fsdp = next(p for p in info.value.problems if p.key == "train.fsdp")
    assert "torchrun --nproc_per_node 2" in fsdp.fix


def test_engine_problems_are_reported_before_anything_loads():
    cfg = RunConfig.model_validate(
        {
            "engine": {"type": "sglang"},  # no servers to talk to
            "train": {"model_path": "/m"},
            "rollout": {"batch_size": 2, "n_samples_per_prompt": 2, "data": {"path": "/nonexistent.jsonl"}},
        }
    )
    with pytest.raises(ConfigError) as info:
        validate_run_config(cfg, {}, cuda_available=False)
    keys = [p.key for p in info.value.problems]
    assert "engine.urls" in keys and any(k.startswith("rollout.data") for k in keys)
    # an embedded engine without its own model_path serves the trainer's model: no problem
    ok = RunConfig.model_validate({"train": {"model_path": "/m"}})
    from verst.rollout.engines.config import engine_problems

    assert engine_problems(ok.engine, fallback_model_path=ok.train.model_path) == []
    assert [p.key for p in engine_problems(ok.engine)] == ["engine.model_path"]


def test_distributed_weight_sync_needs_exactly_one_engine_process():
    cfg = RunConfig.model_validate(
        {
            "engine": {"type": "sglang", "urls": ["http://127.0.0.1:1", "http://127.0.0.1:2"]},
            "train": {"model_path": "/m", "weight_sync": "distributed"},
        }
    )
    problems = [p for p in train_problems(cfg, {}, cuda_available=False) if p.key == "train.weight_sync"]
    assert len(problems) == 1 and "several engines" in problems[0].fix
    one = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"urls": ["http://127.0.0.1:1"]})})
    assert not [p for p in train_problems(one, {}, cuda_available=False) if p.key == "train.weight_sync"]


def test_fsdp_on_cpu_allowed_with_two_processes(tmp_path, tiny_checkpoint):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    cfg = RunConfig.model_validate(
        {
            "train": {"model_path": str(tiny_checkpoint), "fsdp": True},
            "rollout": {"data": {"path": str(data)}},
        }
    )
    validate_run_config(cfg, {"WORLD_SIZE": "2"}, cuda_available=False)
    with pytest.raises(ConfigError):
        validate_run_config(cfg, {}, cuda_available=False)
