"""Where bwrap cannot run, a run that needs the sandbox stops before any work with one line that
says what to install (issue 40): `verst train` with the `code_tests` reward or the `python` tool
exits 2 before its first step, with no traceback and nothing trained. Needs no bwrap: the config
points the sandbox at an executable that does not exist."""

from __future__ import annotations

from pathlib import Path

import pytest

from verst.trainer.cli import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "code_expr"
MISSING = "verst-test-no-such-bwrap"


@pytest.mark.parametrize(
    ("config", "override"),
    [
        ("config.toml", f'rollout.reward.sandbox.bwrap="{MISSING}"'),
        ("config_tool.toml", f'rollout.env.options.python.sandbox.bwrap="{MISSING}"'),
    ],
    ids=["code_tests reward", "python tool"],
)
def test_a_run_without_bwrap_stops_before_any_work_with_the_install_line(tmp_path, capsys, config, override):
    run = tmp_path / "run"
    overrides = [f'run.output_dir="{run}"', "run.num_steps=2", override]
    code = main(["train", str(EXAMPLE / config), *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "the code sandbox needs bwrap, which is not on PATH" in err
    assert "apt-get install bubblewrap" in err
    assert "Traceback" not in err
    assert not list(run.rglob("metrics.jsonl")) or all(
        p.read_text().strip() == "" for p in run.rglob("metrics.jsonl")
    ), "a step ran before the sandbox check"
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
