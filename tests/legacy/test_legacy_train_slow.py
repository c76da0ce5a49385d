"""`verst train` on the legacy path, selected from the config's extra env vars.

Two steps of the reverse-digits example with `run.env.VERST_USE_LEGACY_ROLLOUT_V1 = "1"`: the
trainer drives `LegacyRolloutStrategy` like any other strategy (rollouts, eval, weight sync),
the lifecycle stream is complete, and the trainer's log-probs agree with the engine's.
Slow (loads the trainer): `uv run pytest -m slow tests/legacy`.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reverse_digits"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_verst_train_runs_the_legacy_strategy_from_config_env(tmp_path, monkeypatch, capsys):
    from verst.rollout_legacy import strategy as legacy_strategy
    from verst.trainer.cli import main

    calls: list[tuple[int, bool]] = []
    real = legacy_strategy.generate_rollout

    def spy(args, rollout_id, data_source, evaluation=False):
        calls.append((rollout_id, evaluation))
        return real(args, rollout_id, data_source, evaluation)

    monkeypatch.setattr(legacy_strategy, "generate_rollout", spy)
    eval_rows = (EXAMPLE / "data" / "eval.jsonl").read_text().splitlines()[:16]
    (tmp_path / "eval.jsonl").write_text("\n".join(eval_rows) + "\n")
    run = tmp_path / "run"
    code = main(
        [
            "train",
            str(EXAMPLE / "config.toml"),
            f'run.output_dir="{run}"',
            "run.num_steps=2",
            "run.save_interval=0",
            "rollout.eval.interval=0",
            f'rollout.eval.datasets.heldout.path="{tmp_path / "eval.jsonl"}"',
            'run.env.VERST_USE_LEGACY_ROLLOUT_V1="1"',
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    assert len([c for c in calls if not c[1]]) == 2, calls
    assert any(evaluation for _, evaluation in calls), calls

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "rollout/reward_mean" in r]
    assert len(train_rows) == 2
    assert [r["weight_version"] for r in train_rows] == [1.0, 2.0]
    for r in train_rows:
        assert r["rollout/kept_groups"] > 0 and r["train/logprob_mismatch"] < 1e-3
    kinds = Counter(json.loads(line)["kind"] for line in (run / "lifecycle.jsonl").read_text().splitlines())
    assert kinds["attempt_start"] == kinds["attempt_end"] == kinds["gen_start"] == kinds["gen_end"] > 0
