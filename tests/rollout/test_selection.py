"""Strategy selection: one effective environment decides the strategy and reaches child processes."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from verst.rollout.config import RolloutConfig
from verst.rollout.selection import (
    DEFAULT_STRATEGY_PATH,
    FULLY_ASYNC_STRATEGY_PATH,
    LEGACY_FLAG,
    LEGACY_STRATEGY_PATH,
    _legacy_notice,
    resolve_extra_env_vars,
    resolve_strategy_path,
    use_legacy_rollout_v1,
)

CHILD = """
import json
from verst.rollout.config import RolloutConfig
from verst.rollout.selection import resolve_extra_env_vars, resolve_strategy_path, use_legacy_rollout_v1
env = resolve_extra_env_vars(None)  # the child's own os.environ: what the parent handed it
print(json.dumps({"legacy": use_legacy_rollout_v1(env), "path": resolve_strategy_path(RolloutConfig(), env)}))
"""


@pytest.mark.parametrize("ambient", [None, "1"], ids=["ambient-unset", "ambient-1"])
@pytest.mark.parametrize("from_config", [None, "1"], ids=["config-unset", "config-1"])
def test_strategy_and_child_env_agree(monkeypatch, ambient, from_config):
    if ambient is not None:
        monkeypatch.setenv(LEGACY_FLAG, ambient)
    extra = {LEGACY_FLAG: from_config} if from_config is not None else {"UNRELATED": "x"}

    env = resolve_extra_env_vars(extra)  # reads os.environ: the real ambient flag
    chosen = resolve_strategy_path(RolloutConfig(), env)
    expected_legacy = "1" in (ambient, from_config)
    assert chosen == (LEGACY_STRATEGY_PATH if expected_legacy else DEFAULT_STRATEGY_PATH)

    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert child == {"legacy": expected_legacy, "path": chosen}
    assert env["UNRELATED" if from_config is None else LEGACY_FLAG] == (from_config or "x")


def test_config_wins_over_ambient(monkeypatch):
    monkeypatch.setenv(LEGACY_FLAG, "1")
    monkeypatch.setenv("OTHER", "ambient")
    env = resolve_extra_env_vars({LEGACY_FLAG: "0", "NEW": 3})
    assert env[LEGACY_FLAG] == "0" and env["OTHER"] == "ambient" and env["NEW"] == "3"
    assert resolve_strategy_path(RolloutConfig(), env) == DEFAULT_STRATEGY_PATH


def test_explicit_environ_is_not_os_environ(monkeypatch):
    monkeypatch.setenv(LEGACY_FLAG, "1")
    assert resolve_extra_env_vars(None, {"A": "b"}) == {"A": "b"}


@pytest.mark.parametrize(
    ("value", "expected"),
    [("0", False), ("1", True), ("true", True), ("TRUE", True), ("False", False), (" 1 ", True)],
)
def test_flag_values(value, expected):
    assert use_legacy_rollout_v1({LEGACY_FLAG: value}) is expected


def test_flag_default_off():
    assert use_legacy_rollout_v1({}) is False


@pytest.mark.parametrize("value", ["yes", "on", "2", ""])
def test_malformed_flag_names_valid_values(value):
    with pytest.raises(ValueError, match=r"not a valid value; use one of \['0', '1', 'false', 'true'\]"):
        use_legacy_rollout_v1({LEGACY_FLAG: value})


def test_resolution_order():
    legacy = {LEGACY_FLAG: "1"}
    explicit = RolloutConfig(rollout_function_path="my.mod:Strategy", fully_async=True)
    assert resolve_strategy_path(explicit, legacy) == "my.mod:Strategy"
    assert resolve_strategy_path(RolloutConfig(fully_async=True), {}) == FULLY_ASYNC_STRATEGY_PATH
    assert resolve_strategy_path(RolloutConfig(), legacy) == LEGACY_STRATEGY_PATH
    assert resolve_strategy_path(RolloutConfig(), {}) == DEFAULT_STRATEGY_PATH


def test_deprecation_notice_once_per_process(caplog):
    _legacy_notice.cache_clear()
    with caplog.at_level(logging.WARNING, logger="verst.rollout.selection"):
        for _ in range(3):
            use_legacy_rollout_v1({LEGACY_FLAG: "1"})
        use_legacy_rollout_v1({LEGACY_FLAG: "0"})
    notices = [r for r in caplog.records if "deprecated v1" in r.getMessage()]
    assert len(notices) == 1


def test_only_selection_reads_the_flag():
    """No module of the code base but selection.py reads the flag from an environment mapping."""
    import re
    from pathlib import Path

    reads = re.compile(r"(environ(\.get)?\s*[\[(]|getenv\s*\()\s*[\"']" + LEGACY_FLAG)
    root = Path(__file__).resolve().parents[2] / "packages"
    readers = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if p.name != "selection.py" and reads.search(p.read_text(encoding="utf-8"))
    ]
    assert readers == []
