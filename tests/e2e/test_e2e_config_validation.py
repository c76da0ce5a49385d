"""`verst train` with a bad config: every problem, with its config key and fix, before anything is
created — no run directory, no checkpoint, no traceback, no network.

Out-of-range optimizer values (caught at validation, not by AdamW after the run directory
exists), non-finite numbers, model paths (a path-like value that does not exist is "not found",
never a Hub id; a directory that is not a model says so), user import paths resolved during
validation (a module that is missing, lacks the attribute or raises on import), schema and
cross-section problems in one report, fix lines without `PydanticUndefined`, and a model that
only fails when it loads still leaves no run directory behind.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from verst.trainer.cli import main
from verst.trainer.config_checks import is_hub_id

BASE = """
[run]
num_steps = 1
output_dir = "{out}"
[train]
model_path = "{model}"
num_threads = 1
[rollout]
batch_size = 2
n_samples_per_prompt = 2
max_response_len = 4
[rollout.data]
path = "{data}"
"""


@pytest.fixture
def setup(tmp_path, tiny_checkpoint, monkeypatch):
    """A valid config next to a prompt file and a folder of user modules; `run(*overrides)` runs
    `verst train` in this process and returns (exit code, stderr)."""
    from run_testlib import write_prompts

    data = write_prompts(tmp_path / "p.jsonl", 4)
    out = tmp_path / "run"
    cfg = tmp_path / "c.toml"
    cfg.write_text(BASE.format(out=out, model=tiny_checkpoint, data=data))
    (tmp_path / "v10_broken.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "v10_ok.py").write_text("def reward(sample):\n    return 1.0\nNOT_CALLABLE = 3\n")
    monkeypatch.chdir(tmp_path)

    def run(capsys, *overrides):
        code = main(["train", str(cfg), *overrides])
        err = capsys.readouterr().err
        assert not out.exists(), "a bad config created the run directory"
        assert "Traceback" not in err
        return code, err

    return run, tmp_path


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (["train.betas=[1.5, 0.9]"], "train.betas", "Invalid beta parameter at index 0: 1.5"),
        (["train.eps=0.0"], "train.eps", "greater than 0"),
        (["train.lr=inf"], "train.lr", "must be a finite number, got inf"),
        (["rollout.reward.timeout_s=inf"], "rollout.reward.timeout_s", "must be a finite number"),
        (["train.model_path=/nowhere/model"], "train.model_path", "'/nowhere/model' not found"),
        (["train.model_path=./models/nope"], "train.model_path", "'./models/nope' not found"),
        (["train.ref_model_path=runs/teacher/final"], "train.ref_model_path", "not found"),
        (["train.model_path=."], "train.model_path", "not a Hugging Face model (no config.json"),
        (["train.model_path=p.jsonl"], "train.model_path", "is a file, not a model directory"),
        (
            ["rollout.reward.type=v10_broken:reward"],
            "rollout.reward.type",
            "fails on import: RuntimeError: boom",
        ),
        (["rollout.reward.type=v10_ok:missing"], "rollout.reward.type", "has no attribute 'missing'"),
        (
            ["rollout.reward.type=v10_ok:NOT_CALLABLE"],
            "rollout.reward.type",
            "is a int, not a reward function",
        ),
        (["rollout.generate_function_path=v10_ok:nope"], "rollout.generate_function_path", "no attribute"),
        (["rollout.dynamic_filters=['v10_nomodule:f']"], "rollout.dynamic_filters[0]", "is not installed"),
    ],
)
def test_bad_config_is_reported_with_key_and_fix_before_any_run_directory(
    setup, capsys, overrides, key, says
):
    run, _ = setup
    code, err = run(capsys, *overrides)
    assert code == 2, err
    assert f"- {key}:" in err and says in err, err
    assert "fix:" in err.split(f"- {key}:", 1)[1]


def test_schema_and_cross_section_problems_are_reported_together(setup, capsys):
    run, _ = setup
    code, err = run(capsys, "rollout.batch_size=many", "train.fsdp=true", "train.betas=[2.0, 0.9]")
    assert code == 2
    assert "invalid configuration (3 problems)" in err, err
    for key in ("rollout.batch_size", "train.fsdp", "train.betas"):
        assert f"- {key}:" in err


def test_fix_lines_never_show_pydantic_undefined(setup, capsys):
    run, _ = setup
    code, err = run(capsys, "rollout.stop=5", "run.env=3", "rollout.batch_size=x")
    assert code == 2 and err.count("fix:") == 3, err
    assert "PydanticUndefined" not in err
    assert "(default [])" in err and "(default 8)" in err


def test_a_model_that_fails_only_when_it_loads_leaves_no_run_directory(setup, capsys, tiny_checkpoint):
    run, tmp_path = setup
    broken = tmp_path / "broken_model"
    broken.mkdir()
    shutil.copy(Path(tiny_checkpoint) / "config.json", broken)
    (broken / "model.safetensors").write_text("not safetensors")  # passes validation, fails to load
    code, err = run(capsys, f"train.model_path={broken}")
    assert code == 2 and "- train.model_path: cannot load the model" in err, err


def test_only_clear_hub_ids_are_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M")
    for path in (
        "runs/teacher/final",
        "./models/x",
        "../x/y",
        "/abs/x",
        "~/x/y",
        "gpt2",
        "a/b/",
        "checkpoints/x",
    ):
        assert not is_hub_id(path), path  # paths (or a local folder's child), or not namespace/name
