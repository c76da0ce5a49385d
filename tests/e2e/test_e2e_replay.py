"""`verst replay RUN --step N` (issue 41): a short reverse_digits run with `run.save_rollouts=true`,
then three of its steps replayed from checkpoint N-1 reproduce checkpoint N bit for bit (weights
and optimizer state), with `train.exact_on_policy` off (default suite) and on (slow). A tampered
saved batch or checkpoint makes replay name the differing tensors and exit non-zero; a missing run
dir, checkpoint or saved batch is one clear error naming the fix. With LoRA dropout the
step draws random numbers: the saved RNG states make replay bit-equal, other states do not.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from verst.trainer.cli import EXIT_USER_ERROR, main
from verst.trainer.run.replay import replay_step
from verst.trainer.run.saved_batches import batch_path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reverse_digits"
STEPS = 4
CHOSEN = (1, 3, 4)


def _train(run_dir: Path, *extra: str) -> None:
    code = main(
        [
            "train", str(EXAMPLE / "config.toml"),
            f'run.output_dir="{run_dir}"', f"run.num_steps={STEPS}", "run.save_interval=1",
            f"run.keep_checkpoints={STEPS}", "run.save_rollouts=true", "rollout.eval.interval=0",
            "rollout.batch_size=4", "rollout.n_samples_per_prompt=4",
            "train.micro_batch_size=16", "train.num_threads=1", *extra,
        ]
    )  # fmt: skip
    assert code == 0


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("replay") / "run"
    _train(path)
    return path


def _replay(run_dir: Path, step: int) -> int:
    return main(["replay", str(run_dir), "--step", str(step)])


def test_three_chosen_steps_replay_bit_equal(run_dir, capsys):
    for step in CHOSEN:
        assert _replay(run_dir, step) == 0, capsys.readouterr().out
        out = capsys.readouterr().out
        assert f"replay of step {step}: bit-equal" in out


def test_tampered_rollout_is_reported_with_the_differing_tensors(run_dir, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    path = batch_path(copy, 3)
    saved = torch.load(path, weights_only=False)
    saved["batch"].rewards = saved["batch"].rewards.flip(-1) + 0.5  # other advantages, other update
    torch.save(saved, path)
    assert _replay(copy, 3) == 1
    out = capsys.readouterr().out
    assert "replay of step 3:" in out and "entries differ" in out
    assert "model/" in out and "max_abs_diff=" in out
    report = replay_step(copy, 3, env={})
    assert any(d.name.startswith("optimizer/state/") for d in report.diffs)  # the Adam moments too
    assert all(d.max_abs_diff and d.max_abs_diff > 0 for d in report.diffs if d.name.startswith("model/"))


def test_tampered_checkpoint_names_the_one_tensor(run_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    shard = sorted((copy / "checkpoints" / "step_2" / "model").glob("*.safetensors"))[0]
    tensors = load_file(shard)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 0.25
    save_file(tensors, shard, metadata={"format": "pt"})
    assert _replay(copy, 2) == 1
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()]
    assert lines[0].startswith("replay of step 2: 1 of ")
    assert lines[1].startswith(f"model/{name}: max_abs_diff=0.25")


def test_missing_inputs_are_one_clear_error(run_dir, tmp_path, capsys):
    assert main(["replay", str(tmp_path / "nope"), "--step", "1"]) == EXIT_USER_ERROR
    assert "not a run directory" in capsys.readouterr().err
    assert _replay(run_dir, STEPS + 1) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert f"no checkpoint {STEPS + 1}" in err and "run.save_interval=1" in err
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    batch_path(copy, 2).unlink()
    assert _replay(copy, 2) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "no saved batch for step 2" in err and "run.save_rollouts=true" in err


@pytest.mark.slow  # a second full run: 6-12 s on the shared 2-core box
def test_replay_bit_equal_with_exact_on_policy(tmp_path, capsys):
    run = tmp_path / "exact"
    _train(run, "train.exact_on_policy=true")
    for step in CHOSEN:
        assert _replay(run, step) == 0, capsys.readouterr().out


def test_a_train_step_that_draws_random_numbers_replays_with_the_saved_rng(tmp_path, capsys):
    """LoRA dropout draws from the torch RNG during the train step: replay is bit-equal because it
    restores the RNG states saved with the batch, and another RNG state gives other weights."""
    run = tmp_path / "lora"
    _train(run, "run.num_steps=2", "train.lora={rank = 4, dropout = 0.5}")
    assert _replay(run, 2) == 0, capsys.readouterr().out
    path = batch_path(run, 2)
    saved = torch.load(path, weights_only=False)
    saved["rng"]["torch"] = torch.Generator().manual_seed(12345).get_state()
    torch.save(saved, path)
    assert _replay(run, 2) == 1
    assert "adapter/" in capsys.readouterr().out
