"""reasoning-gym as a data source (seeded, resumable, infinite) and `score_answer` as the reward,
against the real `reasoning_gym` package; and a short `verst train` of the shipped example."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import reasoning_gym

from verst.rollout.config import DataConfig, EvalConfig, EvalDatasetConfig, RolloutConfig
from verst.rollout.data_sources import build_data_source, build_eval_sets, data_source_problems
from verst.rollout.errors import ConfigError
from verst.rollout.integrations.reasoning_gym_data import ReasoningGymSource
from verst.rollout.rewards.registry import BUILTIN_REWARDS
from verst.rollout.validation import validate_rollout_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reasoning_gym"
OPTIONS = {"dataset": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1}, "seed": 7}


def _source(n: int = 2, **options) -> ReasoningGymSource:
    return build_data_source(DataConfig(source="reasoning_gym", options={**OPTIONS, **options}), n)


def test_items_are_reasoning_gyms_own_and_cross_chunks():
    src = _source(chunk_size=5)
    ref = reasoning_gym.create_dataset("chain_sum", min_terms=2, max_terms=2, max_digits=1, seed=7, size=12)
    groups = src.get_samples(12)
    assert [g[0].label["question"] for g in groups] == [ref[i]["question"] for i in range(12)]
    assert all(len(g) == 2 and g[0].prompt == g[0].label["question"] for g in groups)
    assert groups[3][0].metadata["reasoning_gym"] == {"dataset": "chain_sum", "index": 3}


def test_infinite_and_resumable_with_handed_back_groups():
    src = _source()
    first = src.get_samples(3)
    src.add_samples([first[1]])
    state = json.loads(json.dumps(src.state_dict()))  # survives a JSON checkpoint
    expected = [g[0].label for g in src.get_samples(4)]
    resumed = _source()
    resumed.load_state_dict(state)
    assert [g[0].label for g in resumed.get_samples(4)] == expected
    assert expected[0] == first[1][0].label  # the handed-back group is served first
    src.index = 10**9  # infinite: any index generates
    assert src.get_samples(1)[0][0].label["metadata"]["source_index"] == 10**9 % 1000
    other = _source(seed=8)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)


def test_finite_eval_set_and_prompt_template():
    cfg = EvalConfig(
        datasets={
            "rg": EvalDatasetConfig(
                source="reasoning_gym", options={**OPTIONS, "size": 5, "prompt_template": "Q: {question}"}
            )
        }
    )
    ((name, samples),) = build_eval_sets(cfg).items()
    assert name == "rg" and len(samples) == 5 and samples[0].prompt.startswith("Q: State the final answer")


def test_score_answer_is_the_reward():
    entry = _source().get_samples(1)[0][0].label
    rule = BUILTIN_REWARDS["reasoning_gym"]
    assert rule(entry["answer"], entry) == 1.0
    assert rule("nonsense", entry) == reasoning_gym.get_score_answer_fn("chain_sum")(
        answer="nonsense", entry=entry
    )
    with pytest.raises(ValueError, match="not a reasoning-gym entry"):
        rule("1", "1")


def test_config_problems_are_reported_with_their_keys():
    bad = [
        ({"dataset": "no_such_task"}, "rollout.data.options.dataset", "unknown reasoning-gym dataset"),
        ({"dataset": "chain_sum", "config": {"digits": 3}}, "rollout.data.options.config", "no config field"),
        (
            {"dataset": "chain_sum", "config": {"min_terms": 5, "max_terms": 2}},
            "rollout.data.options.config",
            "rejects",
        ),
        ({"dataset": "chain_sum", "sed": 1}, "rollout.data.options.sed", "Extra inputs"),
    ]
    for options, key, why in bad:
        (p,) = data_source_problems(DataConfig(source="reasoning_gym", options=options), "rollout.data")
        assert p.key == key and why in p.why, p
    eval_cfg = {"datasets": {"h": {"source": "reasoning_gym", "options": {"dataset": "chain_sum"}}}}
    with pytest.raises(ConfigError) as info:
        validate_rollout_config(
            RolloutConfig.model_validate({"eval": eval_cfg, "data": {"source": "nope"}}), {}
        )
    msg = str(info.value)
    assert "rollout.eval.datasets.h.options.size" in msg and "rollout.data.source" in msg


@pytest.mark.timeout(300)
def test_verst_train_on_the_example_two_steps(tmp_path, capsys):
    from verst.trainer.cli import main

    run = tmp_path / "run"
    code = main(
        [
            "train",
            str(EXAMPLE / "config.toml"),
            f'run.output_dir="{run}"',
            "run.num_steps=2",
            "run.save_interval=2",
            "rollout.eval.interval=0",
            "rollout.eval.datasets.heldout.options.size=8",
            "train.num_threads=1",
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]
    assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards) and max(rewards) > 0
    assert any("eval/heldout/reward_mean" in r for r in rows)
    import torch

    state = torch.load(run / "checkpoints" / "step_2" / "run_state.pt", weights_only=False)["rollout"]
    assert state["data_source"]["index"] == 2 * 8 and state["data_source"]["dataset"] == "spell_backward"
