"""The code-expression example through `verst train`: generate → sandboxed `code_tests` reward →
train.

Default suite: two small steps of `examples/code_expr/config.toml` — every sample is scored by
running its expression in the sandbox against the hidden tests (the recorded rewards agree
with a direct sandbox run of the recorded responses), and the policy trains on them.
Slow: the README's command in full, held-out pass rate up by at least 0.3
(`uv run pytest -m slow tests/code_example/test_code_expr_e2e.py`).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from verst.rollout.rewards.code_tests import OUTCOMES
from verst.trainer.cli import main

pytestmark = pytest.mark.usefixtures("bwrap_ok")  # every test here runs code in the sandbox

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "code_expr"
WARM_START_PASS_RATE = 0.126
"""Greedy held-out pass rate of the shipped warm start (right only when a == b, plus a few)."""


def _small_eval(tmp_path: Path, n: int) -> Path:
    rows = (EXAMPLE / "data" / "eval.jsonl").read_text().splitlines()[:n]
    path = tmp_path / "eval.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


async def _passed_fraction(rows: list[dict]) -> list[float]:
    """What `code_tests` should give each row: the fraction of its asserts that pass, each
    assert run on its own in the sandbox (not the reward's own program)."""
    from verst.rollout.sandbox import SandboxConfig, SandboxPool

    pool = SandboxPool(SandboxConfig())
    try:
        out = []
        for r in rows:
            code = r["label"]["prefix"] + r["response"].removesuffix("<eos>")
            runs = await asyncio.gather(*(pool.run(code + "\n" + t + "\n") for t in r["label"]["tests"]))
            out.append(sum(x.ok for x in runs) / len(runs))
        return out
    finally:
        await pool.close()


@pytest.mark.timeout(300)
def test_two_steps_generate_score_in_the_sandbox_and_train(tmp_path, capsys):
    run = tmp_path / "run"
    code = main(
        [
            "train",
            str(EXAMPLE / "config.toml"),
            f'run.output_dir="{run}"',
            "run.num_steps=2",
            "run.save_interval=0",
            "rollout.eval.interval=0",
            "rollout.batch_size=4",
            "rollout.n_samples_per_prompt=4",
            f'rollout.eval.datasets.heldout.path="{_small_eval(tmp_path, 8)}"',
        ]
    )
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "rollout/reward_mean" in r]
    assert len(train_rows) == 2
    assert all(r["train/logprob_mismatch"] < 1e-3 and "train/loss" in r for r in train_rows)
    kinds = {k for r in train_rows for k in r if k.startswith("rollout/reward_outcome/")}
    assert kinds and kinds <= {f"rollout/reward_outcome/{k}" for k in OUTCOMES}  # the built-in reward's kinds
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    train = [s for s in samples if s["split"] == "train" and s["status"] == "completed"]
    assert train, "no completed training samples recorded"
    labels = {r["prompt"]: r["label"] for r in map(json.loads, (EXAMPLE / "data" / "train.jsonl").open())}
    distinct = {(s["prompt"], s["response"]): s["reward"] for s in train}
    rewards = sorted(distinct.items(), key=lambda kv: kv[1])
    assert rewards[0][1] == 0 and rewards[-1][1] > 0  # right and wrong answers: something to learn
    picked = rewards[:3] + rewards[-3:]  # the lowest and highest scored, checked independently
    checked = [{"response": r, "label": labels[p]} for (p, r), _ in picked]
    assert [v for _, v in picked] == pytest.approx(asyncio.run(_passed_fraction(checked)))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_example_raises_the_held_out_pass_rate_by_at_least_0_3(tmp_path, capsys):
    run = tmp_path / "run"
    start = time.monotonic()
    code = main(["train", str(EXAMPLE / "config.toml"), f'run.output_dir="{run}"'])
    elapsed = time.monotonic() - start
    assert code == 0, capsys.readouterr().err
    summary = json.loads((run / "summary.json").read_text())
    print(
        f"pass rate {summary['initial_eval_reward']:.3f} -> {summary['final_eval_reward']:.3f} in {elapsed:.0f}s"
    )
    assert summary["initial_eval_reward"] == pytest.approx(WARM_START_PASS_RATE, abs=0.02)
    assert summary["final_eval_reward"] - summary["initial_eval_reward"] >= 0.3
    assert (run / "curves.png").exists()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_tool_variant_learns_to_test_a_candidate_with_the_python_tool(tmp_path, capsys):
    """`config_tool.toml` in full: multi-turn episodes whose tool runs the model's code in the
    sandbox (measured: 0.126 -> 0.995 held-out, every greedy episode calls the tool)."""
    run = tmp_path / "run"
    code = main(["train", str(EXAMPLE / "config_tool.toml"), f'run.output_dir="{run}"'])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_eval_reward"] - summary["initial_eval_reward"] >= 0.3
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last_eval = [r for r in rows if "eval/heldout/reward_mean" in r][-1]
    assert last_eval.get("eval/heldout/env/tool_calls_per_episode", 0) > 0.5
