"""Layouts and up-front placement checks (no Ray needed): plans are consistent for any sizes,
and every bad combination is reported in one ConfigError naming the key and the fix."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from verst.rollout.errors import ConfigError
from verst.rollout.selection import LEGACY_FLAG, resolve_extra_env_vars
from verst.trainer.config import run_config_from_dict, validate_run_config
from verst.trainer.placement import RaySection, plan_placement, resolve_device
from verst.trainer.placement.ray_cluster import MACHINE_LOCAL_PREFIXES, MACHINE_LOCAL_VARS, actor_env_vars


@given(
    n=st.integers(1, 16),
    cpus=st.sampled_from([0.5, 1.0, 4.0]),
    rollout_cpus=st.sampled_from([0.0, 1.0, 2.0]),
    rollout_gpus=st.sampled_from([0.0, 1.0, 4.0]),
    layout=st.sampled_from(["colocated", "disaggregated"]),
    device=st.sampled_from(["cpu", "gpu"]),
)
def test_plan_fits_its_bundles(n, cpus, rollout_cpus, rollout_gpus, layout, device):
    ray = RaySection(
        num_train_actors=n,
        cpus_per_train_actor=cpus,
        rollout_num_cpus=rollout_cpus,
        rollout_num_gpus=rollout_gpus,
        layout=layout,
    )
    plan = plan_placement(ray, device)
    assert len(plan.bundles) == len(plan.train) == n
    assert [s.bundle for s in plan.train] == list(range(n))  # one train rank per bundle
    # what the actors pinned to each bundle ask for fits in it
    for i, bundle in enumerate(plan.bundles):
        slots = [s for s in plan.train if s.bundle == i]
        if plan.rollout.bundle == i:
            slots.append(plan.rollout)
        assert sum(s.num_cpus for s in slots) <= bundle["CPU"] + 1e-9
        assert sum(s.num_gpus for s in slots) <= bundle.get("GPU", 0.0) + 1e-9
    assert all(("GPU" in b) == (device == "gpu") for b in plan.bundles)
    if layout == "colocated":
        assert plan.rollout.bundle == 0
        if device == "gpu":  # train rank 0 and the engines share bundle 0's device
            assert plan.train[0].num_gpus > 0 and plan.rollout.num_gpus > 0
    else:
        assert plan.rollout.bundle is None and plan.rollout.num_gpus == rollout_gpus
        assert all(s.num_gpus == (1.0 if device == "gpu" else 0.0) for s in plan.train)


def test_resolve_device():
    assert resolve_device(RaySection(num_train_actors=4), cluster_gpus=8) == "gpu"
    assert resolve_device(RaySection(num_train_actors=4), cluster_gpus=2) == "cpu"
    assert resolve_device(RaySection(device="gpu"), cluster_gpus=0) == "gpu"


def _problems(data: dict, env: dict | None = None) -> list:
    base = {"train": {"model_path": "/m"}, "rollout": {"data": {"path": "/d.jsonl"}}}
    for k, v in data.items():
        base.setdefault(k, {}).update(v)
    with pytest.raises(ConfigError) as info:
        validate_run_config(run_config_from_dict(base), env or {}, cuda_available=False)
    return info.value.problems


def test_placement_problems_all_in_one_error():
    problems = _problems(
        {
            "run": {
                "placement": "ray",
                "ray": {"layout": "colocated", "device": "cpu", "num_train_actors": 1},
            },
            "rollout": {"fully_async": True, "data": {"path": "/d.jsonl"}},
            "train": {"model_path": "/m", "fsdp": True},
        },
        env={"WORLD_SIZE": "2"},
    )
    keys = [p.key for p in problems]
    assert "run.ray.layout" in keys  # fully-async needs disaggregated
    assert "run.ray.num_train_actors" in keys  # FSDP on one CPU actor
    assert "run.placement" in keys  # under torchrun
    fix = next(p for p in problems if p.key == "run.ray.layout").fix
    assert "disaggregated" in fix


def test_ray_address_without_ray_placement():
    problems = _problems({"run": {"ray_address": "10.0.0.1:6379"}})
    assert [p.key for p in problems if p.key.startswith("run.")] == ["run.ray_address"]


def test_gpu_layout_checks():
    problems = _problems(
        {
            "run": {"placement": "ray", "ray": {"layout": "disaggregated", "device": "gpu"}},
            "engine": {"type": "sglang_launch", "model_path": "/m"},
        }
    )
    assert "run.ray.rollout_num_gpus" in [p.key for p in problems]
    problems = _problems(
        {
            "run": {"placement": "ray", "ray": {"layout": "colocated", "device": "gpu"}},
            "engine": {"type": "sglang_launch", "model_path": "/m", "num_engines": 2},
        }
    )
    assert "run.ray.layout" in [p.key for p in problems]


_names = st.sampled_from(
    ["PATH", "HOME", "CUDA_VISIBLE_DEVICES", "RANK", "RAY_ADDRESS", "HF_HOME", "MY_FLAG", LEGACY_FLAG]
)


@given(
    ambient=st.dictionaries(_names, st.sampled_from(["0", "1", "x"])),
    explicit=st.dictionaries(_names, st.sampled_from(["0", "1", "y"])),
)
def test_actor_env_vars_properties(ambient, explicit):
    env = resolve_extra_env_vars(explicit, environ=ambient)  # the entry point's one mapping
    sent = actor_env_vars(env, explicit)
    for key, value in explicit.items():
        assert sent[key] == value  # the config's variables always reach the actors
    for key in sent:
        assert (
            key in explicit
            or key == LEGACY_FLAG
            or (key not in MACHINE_LOCAL_VARS and not key.startswith(MACHINE_LOCAL_PREFIXES))
        )
    assert sent[LEGACY_FLAG] == env.get(LEGACY_FLAG, "0")  # pinned, never inherited from a node
    for key in ("HF_HOME", "MY_FLAG"):
        assert sent.get(key) == env.get(key)  # ordinary variables pass through
