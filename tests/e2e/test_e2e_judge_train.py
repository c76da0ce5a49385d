"""`verst train` with a judge reward end to end: the reverse-digits example's policy, judged by
its own warm-start checkpoint on a separate embedded engine (allowed; the judge is never refit),
two steps through the CLI. Proves the pipeline (config → judge engine → rewards → train → close),
not learning: the warm start is no trained judge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verst.trainer.cli import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reverse_digits"


@pytest.mark.timeout(300)
def test_verst_train_with_the_policy_checkpoint_as_judge(tmp_path, capsys):
    rows = (EXAMPLE / "data" / "eval.jsonl").read_text().splitlines()[:8]
    small_eval = tmp_path / "eval.jsonl"
    small_eval.write_text("\n".join(rows) + "\n")
    warm = EXAMPLE / "model" / "warm_start"
    run = tmp_path / "run"
    judge = "rollout.reward.judge"
    code = main(
        [
            "train",
            str(EXAMPLE / "config.toml"),
            f'run.output_dir="{run}"',
            "run.num_steps=2",
            "run.save_interval=0",
            "rollout.batch_size=4",
            "rollout.n_samples_per_prompt=4",
            "rollout.eval.interval=0",
            f'rollout.eval.datasets.heldout.path="{small_eval}"',
            'rollout.reward.type="judge"',
            f'{judge}.engine={{type="embedded", model_path="{warm}", device="cpu", num_threads=1}}',
            f'{judge}.parser="yes_no_logprob"',
            f'{judge}.yes="1"',
            f'{judge}.no="0"',
            f'{judge}.template="{{prompt}}{{response}}|{{label}}|"',
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in metrics if "rollout/reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(0.0 < r["rollout/reward_mean"] < 1.0 and not r.get("rollout/reward_errors") for r in train)
    assert train[-1]["weight_version"] == 2.0  # the policy was refit twice; the judge never was
