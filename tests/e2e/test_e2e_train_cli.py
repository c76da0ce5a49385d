"""`verst train` end to end: the real embedded engine, the real trainer, through the CLI entry point.

A few steps of the reverse-digits example (its shipped warm start, data and reward), with a
small eval set so the test stays quick; then the run directory is checked file by file.
"""

from __future__ import annotations

import json
import shutil
import threading
import tomllib
from pathlib import Path

import pytest

from verst.trainer.cli import main
from verst.trainer.config import load_run_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reverse_digits"


@pytest.fixture()
def small_eval(tmp_path: Path) -> Path:
    rows = (EXAMPLE / "data" / "eval.jsonl").read_text().splitlines()[:32]
    path = tmp_path / "eval_small.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.timeout(300)
def test_verst_train_writes_a_complete_run_directory(tmp_path, small_eval, capsys):
    run = tmp_path / "run"
    code = main(
        [
            "train",
            str(EXAMPLE / "config.toml"),
            f'run.output_dir="{run}"',
            "run.num_steps=3",
            "run.save_interval=2",
            "run.keep_checkpoints=2",
            "rollout.eval.interval=0",
            f'rollout.eval.datasets.heldout.path="{small_eval}"',
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "run finished" in out.out

    # the resolved config reloads to the config that ran (paths made absolute)
    cfg = load_run_config(run / "config.toml")
    assert cfg.run.num_steps == 3 and Path(cfg.train.model_path).is_absolute()
    assert tomllib.loads((run / "config.toml").read_text())["rollout"]["reward"]["type"].startswith(
        "reverse_digits"
    )

    # metrics: eval at start (step 0) and end (step 3), and one row per training step
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "rollout/reward_mean" in r]
    eval_rows = [r for r in rows if "eval/heldout/reward_mean" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    assert [r["step"] for r in eval_rows] == [0, 3]
    for r in train_rows:
        assert 0.0 <= r["rollout/reward_mean"] <= 1.0
        assert r["train/logprob_mismatch"] < 1e-3  # trainer and engine agree on the sampled tokens
    assert train_rows[-1]["weight_version"] == 3.0  # one weight sync per step

    # TensorBoard, lifecycle events, checkpoints, curves, summary
    assert any(p.name.startswith("events.out.tfevents") for p in (run / "tensorboard").iterdir())
    events = [json.loads(line) for line in (run / "lifecycle.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds.count("attempt_start") == kinds.count("attempt_end") >= 3 * 64
    assert {"gen_start", "gen_end"} <= set(kinds)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2", "step_3"]
    assert (run / "curves.png").stat().st_size > 10_000
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps_done"] == 3 and summary["weight_version"] == 3
    assert 0.0 <= summary["initial_eval_reward"] <= 1.0 and "phase_seconds" in summary
    assert set(summary["phase_seconds"]) >= {"rollout", "train", "sync", "eval"}

    # `verst eval` on the run directory evaluates its newest checkpoint: the same number the run logged last
    code = main(
        [
            "eval",
            str(EXAMPLE / "config.toml"),
            str(run),
            "--set",
            f'rollout.eval.datasets.heldout.path="{small_eval}"',
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    result = json.loads(out[out.index("{") :])
    assert result["model"].endswith("step_3/model")
    assert result["eval/heldout/reward_mean"] == pytest.approx(summary["final_eval_reward"], abs=1e-6)


def test_verst_sft_trains_on_response_tokens_and_saves(tmp_path, capsys):
    sft_rows = (EXAMPLE / "data" / "sft.jsonl").read_text().splitlines()[:64]
    (tmp_path / "sft.jsonl").write_text("\n".join(sft_rows) + "\n")
    (tmp_path / "sft.toml").write_text(
        f'[sft]\nmodel_path = "{EXAMPLE / "model" / "init"}"\ndata_path = "sft.jsonl"\n'
        'output_dir = "out"\nsteps = 4\nbatch_size = 16\nlog_every = 2\n'
    )
    assert main(["sft", str(tmp_path / "sft.toml"), "lr=1e-3"]) == 0
    out = capsys.readouterr().out
    assert "sft step 2/4" in out and "sft finished" in out
    assert (tmp_path / "out" / "model.safetensors").exists() and (
        tmp_path / "out" / "tokenizer.json"
    ).exists()
    assert main(["sft", str(tmp_path / "sft.toml"), "stepz=3"]) == 2
    assert "did you mean 'steps'?" in capsys.readouterr().err


def test_bad_data_is_a_user_error_without_traceback(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "12="}\n[1, 2]\n')
    shutil.copy(EXAMPLE / "reverse_digits_reward.py", tmp_path / "reverse_digits_reward.py")
    loops_before = {t for t in threading.enumerate() if t.name == "verst-rollout-loop"}
    code = main(
        [
            "train",
            str(EXAMPLE / "config.toml"),
            f'run.output_dir="{tmp_path / "run"}"',
            f'rollout.data.path="{data}"',
            "run.num_steps=1",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "bad.jsonl:2" in err and "Traceback" not in err
    # the half-built rollout side stopped its event-loop thread
    leaked = {
        t for t in threading.enumerate() if t.name == "verst-rollout-loop" and t.is_alive()
    } - loops_before
    assert not leaked
