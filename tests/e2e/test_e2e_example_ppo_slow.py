"""PPO + GAE on reverse_digits, in full: `verst train examples/reverse_digits/config_ppo.toml`.

Slow (about 5–10 minutes on 2 busy CPU cores): run with `uv run pytest -m slow tests/e2e`.
Checks the example's promise — held-out greedy eval reward rises by at least 0.3 over the
shipped warm start — with a critic trained alongside (its value loss falls, the policy waits for
the critic warm-up, a checkpoint holds the critic's state).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verst.trainer.cli import main
from verst.trainer.run.checkpoint import latest_checkpoint

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reverse_digits"


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_ppo_example_raises_eval_reward_by_at_least_0_3(tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", str(EXAMPLE / "config_ppo.toml"), f'run.output_dir="{run}"'])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["initial_eval_reward"] == pytest.approx(0.384, abs=0.02)
    assert summary["final_eval_reward"] - summary["initial_eval_reward"] >= 0.3
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/critic/vf_loss" in r]
    assert [r["train/critic/policy_updated"] for r in train[:6]] == [0.0] * 5 + [1.0]  # warm-up 5
    first = sum(r["train/critic/vf_loss"] for r in train[:5]) / 5
    last = sum(r["train/critic/vf_loss"] for r in train[-10:]) / 10
    assert last < first
    ckpt = latest_checkpoint(run / "checkpoints")
    assert ckpt is not None and (ckpt / "critic" / "state.pt").is_file()
