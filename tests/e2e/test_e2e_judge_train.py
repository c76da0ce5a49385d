"""`verst train` with a judge reward end to end: the reverse-digits example's policy, judged by
its own warm-start checkpoint on a separate embedded engine (allowed; the judge is never refit),
two steps through the CLI, the held-out set scored by the example's rule instead
(`rollout.eval.datasets.heldout.reward`). Proves the pipeline (config → judge engine → rewards →
train → close) and the judge's counters in metrics.jsonl, not learning: the warm start is no
trained judge (examples/judge_digits trains one)."""

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
            'rollout.eval.datasets.heldout.reward={type="reverse_digits_reward:reward"}',
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in metrics if "rollout/reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(0.0 < r["rollout/reward_mean"] < 1.0 and not r.get("rollout/reward_errors") for r in train)
    assert train[-1]["weight_version"] == 2.0  # the policy was refit twice; the judge never was
    # each step's judge calls, cache hits and errors (that step's, not the run's totals)
    assert all(r["reward/judge/calls"] > 0 and r["reward/judge/errors"] == 0 for r in train)
    assert all(r["reward/judge/calls"] + r["reward/judge/cache_hits"] == 16 for r in train)
    evals = [r for r in metrics if "eval/heldout/reward_mean" in r]
    assert len(evals) == 2  # start and end, scored by the rule: the judge is not called
    assert all(r.get("eval/reward/judge/calls", 0) == 0 for r in evals)
    # the step-0 eval is the warm start's greedy answers scored by the rule, recomputed here
    assert evals[0]["eval/heldout/reward_mean"] == pytest.approx(_greedy_rule_score(warm, rows), abs=1e-9)


def _greedy_rule_score(model: Path, rows: list[str]) -> float:
    """The example rule's mean score of `model`'s greedy answers (12 new tokens) to `rows`."""
    import asyncio
    import sys

    from verst.rollout.engine import GenerateRequest, SamplingParams
    from verst.rollout.engines.embedded.engine import EmbeddedEngine

    sys.path.insert(0, str(EXAMPLE))
    from reverse_digits_reward import score

    async def run() -> float:
        engine = EmbeddedEngine.from_pretrained(model)
        tok = engine.tokenizer
        try:
            total = 0.0
            for row in map(json.loads, rows):
                ids = tok.encode(row["prompt"], add_special_tokens=False)
                out = await engine.generate(
                    GenerateRequest(ids, SamplingParams(max_new_tokens=12, temperature=0.0))
                )
                text = out.text or tok.decode(out.output_ids)
                total += score(text, row["label"], out.finish_reason == "stop")
            return total / len(rows)
        finally:
            await engine.close()

    return asyncio.run(run())
