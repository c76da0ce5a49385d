"""`verst train` on the agentic examples, end to end: real embedded engine, real trainer, the
built-in tool environment (tool_math) and a custom multi-turn environment (guess_number).

A couple of small steps each: the metrics carry the agentic keys, trainer and engine agree on
the model tokens of the multi-turn trajectories, and the lifecycle stream has one attempt per
episode with its turn and tool spans nested inside.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from verst.trainer.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _small_eval(tmp_path: Path, example: str, n: int) -> Path:
    rows = (EXAMPLES / example / "data" / "eval.jsonl").read_text().splitlines()[:n]
    path = tmp_path / f"{example}_eval.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def _train(tmp_path: Path, example: str, capsys, *overrides: str) -> Path:
    run = tmp_path / example
    code = main(
        [
            "train",
            str(EXAMPLES / example / "config.toml"),
            f'run.output_dir="{run}"',
            "run.num_steps=2",
            "run.save_interval=0",
            "rollout.eval.interval=0",
            "rollout.batch_size=4",
            "rollout.n_samples_per_prompt=4",
            f'rollout.eval.datasets.heldout.path="{_small_eval(tmp_path, example, 8)}"',
            *overrides,
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    return run


def _check_lifecycle(run: Path, *, tools: bool) -> None:
    events = [json.loads(line) for line in (run / "lifecycle.jsonl").read_text().splitlines()]
    kinds = Counter(e["kind"] for e in events)
    assert kinds["attempt_start"] == kinds["attempt_end"] == 2 * 16  # one attempt per episode
    assert kinds["turn_start"] == kinds["turn_end"] >= kinds["attempt_start"]
    assert kinds["tool_start"] == kinds["tool_end"] and (kinds["tool_start"] > 0) == tools
    open_turns: dict[tuple, int] = {}
    for e in events:  # turn and tool spans sit inside their episode's attempt
        key = (e["rollout_id"], e["sample_index"])
        if e["kind"] == "attempt_start":
            open_turns[key] = 0
        elif e["kind"] in ("turn_start", "tool_start"):
            assert key in open_turns
        elif e["kind"] == "turn_end":
            assert e["detail"]["duration_s"] >= 0 and "status" in e["detail"]
        elif e["kind"] == "attempt_end":
            del open_turns[key]
    assert not open_turns


@pytest.mark.timeout(300)
def test_tool_math_trains_on_multi_turn_tool_trajectories(tmp_path, capsys):
    run = _train(tmp_path, "tool_math", capsys)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "rollout/reward_mean" in r]
    assert len(train_rows) == 2
    for r in train_rows:
        assert r["rollout/turns_mean"] >= 1 and "rollout/env/tool_calls" in r
        assert r["train/logprob_mismatch"] < 1e-3  # the trainer scores the engine's exact tokens
    assert any(r["rollout/env/tool_calls"] > 0 for r in train_rows)
    assert any("eval/heldout/termination/stop" in r for r in rows)
    _check_lifecycle(run, tools=True)
    _check_trajectories(run)


def _check_trajectories(run: Path) -> None:
    """The full trajectories the run recorded: the default bound of each step, with the token text,
    the segments, and the per-token values the train step used."""
    from verst.trainer.dashboard.trajectories import read_trajectories, turns

    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    samples = [s for s in samples if s["split"] == "train"]
    recorded = list(read_trajectories(run, split="train"))
    for step in (1, 2):
        mine = [t for t in recorded if t["step"] == step]
        failed = {
            s["sample_index"] for s in samples if s["step"] == step and s["status"] in ("failed", "aborted")
        }
        others = sorted(
            s["sample_index"] for s in samples if s["step"] == step and s["sample_index"] not in failed
        )
        assert {t["sample_index"] for t in mine if t["reason"] == "sampled"} == set(others[:8])  # the default
        assert {t["sample_index"] for t in mine if t["reason"] != "sampled"} == failed
    tool_episodes = [t for t in recorded if any(s["source"] == "env" for s in t["segments"])]
    assert tool_episodes, "no recorded episode called the tool"
    for t in recorded:
        r = t["response_length"]
        assert len(t["tokens"]) == t["prompt_length"] + r and len(t["token_text"]) == len(t["tokens"])
        assert "".join(p["text"] for p in turns(t) if p["source"] == "env").count("<tool_response>") == sum(
            1 for s in t["segments"] if s["source"] == "env"
        )
        trained = [i for i, m in enumerate(t["loss_mask"]) if m]
        assert len(t["advantages"]) == len(t["trainer_logprobs"]) == r
        assert max(abs(t["trainer_logprobs"][i] - t["rollout_logprobs"][i]) for i in trained) < 1e-3
        row = next(s for s in samples if s["step"] == t["step"] and s["sample_index"] == t["sample_index"])
        assert row["advantage"] == pytest.approx(sum(t["advantages"][i] for i in trained) / len(trained))


@pytest.mark.timeout(300)
def test_guess_number_runs_feedback_episodes_end_to_end(tmp_path, capsys):
    run = _train(tmp_path, "guess_number", capsys)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "rollout/reward_mean" in r]
    assert len(train_rows) == 2
    for r in train_rows:
        assert r["rollout/turns_mean"] > 1  # feedback turns happened
        assert r.get("rollout/termination/env_done", 0.0) + r.get(
            "rollout/termination/max_turns", 0.0
        ) == pytest.approx(1.0)
        assert r["train/logprob_mismatch"] < 1e-3
    _check_lifecycle(run, tools=False)
