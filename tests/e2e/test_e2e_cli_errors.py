"""CLI errors: a bad config lists every problem with its fix, exits 2, and prints no traceback."""

from __future__ import annotations

import subprocess
import sys
import typing

import pytest
from pydantic import BaseModel

from verst.rollout.variants import VariantTable, variant_table_of
from verst.trainer.cli import main
from verst.trainer.config import RunConfig

BAD = """
[run]
num_step = 5
[rollout]
batch_size = 0
temperatur = 1.0
[train]
lr = "fast"
[trian]
x = 1
"""


def test_bad_config_in_a_real_process_lists_every_problem(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(BAD)
    proc = subprocess.run(
        [sys.executable, "-m", "verst.trainer.cli", "train", str(path), "rollout.n_samples_per_prompt=-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    # the 6 schema problems AND the cross-section ones (no model anywhere), in one report
    assert "invalid configuration (8 problems)" in proc.stderr
    for key in (
        "run.num_step",
        "rollout.batch_size",
        "rollout.temperatur",
        "train.lr",
        "trian",
        "rollout.n_samples_per_prompt",
        "engine.model_path",
        "train.model_path",
    ):
        assert f"- {key}:" in proc.stderr
    assert proc.stderr.count("fix:") == 8


@pytest.mark.parametrize(
    ("toml", "override", "suggestion"),
    [
        ("[rollout]\nn_samples_per_promt = 4\n", None, "did you mean 'rollout.n_samples_per_prompt'?"),
        ("", "train.learning_rate=1e-4", None),
        ("", "algorithm.kl_coeff=0.1", "did you mean 'algorithm.kl_coef'?"),
        ("[rollout.data]\npth = 'x'\n", None, "did you mean 'rollout.data.path'?"),
    ],
)
def test_unknown_key_suggests_the_closest_valid_one(tmp_path, capsys, toml, override, suggestion):
    path = tmp_path / "c.toml"
    path.write_text(toml)
    code = main(["train", str(path), *([override] if override else [])])
    err = capsys.readouterr().err
    assert code == 2 and "unknown key" in err and "Traceback" not in err
    if suggestion:
        assert suggestion in err
    else:
        assert "valid keys here:" in err and "lr" in err


def test_missing_file_and_cross_section_problems(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.toml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    path = tmp_path / "c.toml"
    path.write_text("[train]\nfsdp = true\n")  # no model, and FSDP in one CPU process
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "train.fsdp" in err and "train.model_path" in err and "fix:" in err


def _is_section(ann: typing.Any) -> bool:
    """A sub-section: a model, or a variant field (`VariantTable.field`: one model per `type`)."""
    if any(isinstance(m, VariantTable) for m in getattr(ann, "__metadata__", ())):
        return True
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def _fields(model: type[BaseModel], prefix: str = "") -> typing.Iterator[str]:
    for name, field in model.model_fields.items():
        ann = field.annotation
        optional = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(optional) == 1 and isinstance(optional[0], type) and issubclass(optional[0], BaseModel):
            ann = optional[0]  # an optional section (train.lora)
        if variant_table_of(field) is not None:
            yield f"[{prefix}{name}]"  # one table per variant, each with its own fields
        elif isinstance(ann, type) and issubclass(ann, BaseModel):
            yield f"[{prefix}{name}]"
            yield from _fields(ann, f"{prefix}{name}.")
        elif typing.get_origin(ann) is dict and _is_section(typing.get_args(ann)[1]):
            yield f"[{prefix}{name}.<name>]"  # a table of named sub-sections
        else:
            yield f"  {name} = "


def test_train_help_lists_every_section_and_field(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for needle in _fields(RunConfig):
        assert needle in out, needle
    assert "Peak learning rate of AdamW." in out  # meanings, not just names
    assert "lr = 1e-06" in out  # with defaults
    assert "[rollout.eval.datasets.<name>]" in out


def test_top_level_help_and_no_command(capsys):
    assert main([]) == 2
    assert "train" in capsys.readouterr().out


def test_serve_delegates_to_the_engine_server(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--model" in out and "--port" in out


def test_sft_help_lists_its_fields(capsys):
    with pytest.raises(SystemExit):
        main(["sft", "--help"])
    out = capsys.readouterr().out
    for field in ("model_path", "data_path", "output_dir", "steps", "batch_size", "lr"):
        assert f"  {field} = " in out
