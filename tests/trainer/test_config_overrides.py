"""Switching a variant's `type` on the command line (#25 item 11), for every variant table: the
dotted form (`engine.type="sglang" 'engine.urls=[...]'`) on a file whose table holds the previous
type's keys drops those keys with one line naming them; the table form
(`engine={type="sglang", urls=[...]}`) works too. Typos and keys the user typed are never dropped."""

from __future__ import annotations

import logging

import pytest

from verst.rollout.errors import ConfigError
from verst.trainer.config import load_run_config

# (file TOML, dotted overrides, table override, dropped keys, a check of the loaded config)
CASES = {
    "engine": (
        '[engine]\ntype = "embedded"\ndevice = "cpu"\ndtype = "float32"\nmax_batch_size = 8\n',
        ['engine.type="sglang"', 'engine.urls=["http://127.0.0.1:30000"]'],
        'engine={type="sglang", urls=["http://127.0.0.1:30000"]}',
        ["engine.device", "engine.dtype", "engine.max_batch_size"],
        lambda c: c.engine.type == "sglang" and c.engine.urls == ["http://127.0.0.1:30000"],
    ),
    "engine, no type in the file (the default)": (
        '[engine]\ndevice = "cpu"\n',
        ['engine.type="sglang"', 'engine.urls=["http://127.0.0.1:30000"]'],
        'engine={type="sglang", urls=["http://127.0.0.1:30000"]}',
        ["engine.device"],
        lambda c: c.engine.type == "sglang",
    ),
    "weight sync": (
        '[train.weight_sync]\ntype = "distributed"\nbackend = "gloo"\nbucket_bytes = 1024\n',
        ['train.weight_sync.type="disk"'],
        'train.weight_sync={type="disk"}',
        ["train.weight_sync.backend", "train.weight_sync.bucket_bytes"],
        lambda c: c.train.weight_sync.type == "disk",
    ),
    "advantage": (
        '[algorithm.advantage]\ntype = "grpo"\nnormalize_std = false\n',
        ['algorithm.advantage.type="reinforce_pp"', "algorithm.advantage.gamma=0.9"],
        'algorithm.advantage={type="reinforce_pp", gamma=0.9}',
        ["algorithm.advantage.normalize_std"],
        lambda c: c.algorithm.advantage.type == "reinforce_pp" and c.algorithm.advantage.gamma == 0.9,
    ),
    "policy loss": (
        '[algorithm.policy_loss]\ntype = "ppo"\ndual_clip_c = 3.0\neps_clip_low = 0.1\n',
        ['algorithm.policy_loss.type="gspo"'],
        'algorithm.policy_loss={type="gspo", eps_clip_low=0.1}',
        ["algorithm.policy_loss.dual_clip_c"],
        lambda c: c.algorithm.policy_loss.type == "gspo" and c.algorithm.policy_loss.eps_clip_low == 0.1,
    ),
    "opd teacher": (
        '[opd.teachers.t]\ntype = "trainer"\nmodel_path = "m"\ndtype = "bfloat16"\n',
        ['opd.teachers.t.type="engine"'],
        'opd.teachers.t={type="engine", model_path="m"}',
        ["opd.teachers.t.dtype"],
        lambda c: c.opd.teachers["t"].type == "engine" and c.opd.teachers["t"].model_path == "m",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dotted_type_switch_drops_the_previous_types_keys_with_one_line(case, tmp_path, caplog):
    text, dotted, _, dropped, check = CASES[case]
    path = tmp_path / "c.toml"
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="verst.trainer.config_overrides"):
        cfg = load_run_config(path, dotted)
    assert check(cfg)
    (line,) = [r.getMessage() for r in caplog.records]
    assert all(k in line for k in dropped) and "dropped" in line, line


@pytest.mark.parametrize("case", list(CASES))
def test_table_form_type_switch_works_and_drops_nothing_silently(case, tmp_path, caplog):
    text, _, table, _, check = CASES[case]
    path = tmp_path / "c.toml"
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="verst.trainer.config_overrides"):
        assert check(load_run_config(path, [table]))
    assert not caplog.records


def test_typos_and_typed_keys_of_the_previous_type_are_still_refused(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[engine]\ntype = "embedded"\ndevice = "cpu"\nurlz = 1\n')
    with pytest.raises(ConfigError) as info:
        load_run_config(
            path, ['engine.type="sglang"', "engine.max_batch_size=4", 'engine.urls=["http://x:1"]']
        )
    keys = {p.key for p in info.value.problems}
    assert keys == {"engine.urlz", "engine.max_batch_size"}, keys  # device was dropped, these were not


def test_same_type_override_drops_nothing(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[engine]\ntype = "embedded"\ndevice = "cpu"\n')
    assert load_run_config(path, ['engine.type="embedded"']).engine.device == "cpu"
