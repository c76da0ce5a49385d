"""`train.exact_on_policy`: rollout log-probs equal to the trainer's, bit for bit, end to end.

`verst train` on the examples with the real embedded engine and trainer; every step's
`rollout/mismatch_tokens` (response tokens whose engine and trainer log-probs differ at all) must
be 0 over the tokens checked, with `auto`'s layouts, for engine batch sizes 1, 7 and 64 and
prefix sharing on and off, single-turn (reverse_digits) and multi-turn with tool observations
(tool_math); slow: the fixed shared-prompt and packed trainer layouts, LoRA (lora.toml) and MoE
with R3 routing replay (moe_digits). Without the setting the same runs differ (`test_default_run_differs`). Where it
cannot hold, validation refuses it with one line before anything is created.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verst.trainer.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _small_eval(tmp_path: Path, example: str, n: int) -> Path:
    data = EXAMPLES / example / "data"
    if not data.is_dir():  # moe_digits reads reverse_digits' data
        data = EXAMPLES / "reverse_digits" / "data"
    rows = (data / "eval.jsonl").read_text().splitlines()[:n]
    path = tmp_path / f"{example}_eval.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def _run(tmp_path: Path, example: str, capsys, *overrides: str, config: str = "config.toml") -> list[dict]:
    run = tmp_path / f"{example}_run"
    code = main(
        [
            "train",
            str(EXAMPLES / example / config),
            f'run.output_dir="{run}"',
            "run.save_interval=0",
            "rollout.eval.interval=0",
            f'rollout.eval.datasets.heldout.path="{_small_eval(tmp_path, example, 8)}"',
            *overrides,
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/loss" in r]


def _assert_exact(steps: list[dict], n: int) -> None:
    assert len(steps) == n
    for s in steps:
        assert s["rollout/mismatch_checked_tokens"] > 0
        assert s["rollout/mismatch_tokens"] == 0, s
        assert s["rollout/mismatch_max"] == 0.0


def test_reverse_digits_exact_with_batch_7_and_prefix_sharing(tmp_path, capsys):
    steps = _run(
        tmp_path,
        "reverse_digits",
        capsys,
        "run.num_steps=2",
        "train.exact_on_policy=true",
        "engine.max_batch_size=7",
        "rollout.batch_size=4",
        "rollout.n_samples_per_prompt=4",
    )
    _assert_exact(steps, 2)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["shared_prompt", "packed"])
def test_reverse_digits_exact_in_shared_prompt_and_packed_layouts(tmp_path, capsys, layout):
    """The trainer's other layouts: each sequence of a shared-prompt or packed row is attended as
    that sequence alone, so the log-probs are the engine's bits (micro-batches of 8 rows: several
    rows per micro-batch, groups split across them)."""
    steps = _run(
        tmp_path,
        "reverse_digits",
        capsys,
        "run.num_steps=2",
        "train.exact_on_policy=true",
        f"train.layout={layout}",
        "train.micro_batch_size=8",
        "engine.max_batch_size=7",
        "rollout.batch_size=4",
        "rollout.n_samples_per_prompt=4",
    )
    _assert_exact(steps, 2)  # a fixed layout runs in every micro-batch (its probe matched padded bit for bit)


@pytest.mark.slow
def test_reverse_digits_lora_exact(tmp_path, capsys):
    """LoRA (examples/reverse_digits/lora.toml): the engine applies the refitted adapter with
    PEFT's ops in PEFT's order, so after each adapter refit every token is still equal."""
    steps = _run(
        tmp_path,
        "reverse_digits",
        capsys,
        "run.num_steps=3",
        "train.exact_on_policy=true",
        "engine.max_batch_size=7",
        "rollout.batch_size=4",
        "rollout.n_samples_per_prompt=4",
        "train.lr=0.05",  # a large step: the adapter's B moves off zero from the first refit
        config="lora.toml",
    )
    _assert_exact(steps, 3)


@pytest.mark.slow
def test_moe_digits_exact_with_routing_replay(tmp_path, capsys):
    """MoE (examples/moe_digits, Qwen3-MoE) with R3 routing replay: the trainer replays the
    engine's experts and its log-probs are the engine's bits; its own routers agree everywhere."""
    steps = _run(
        tmp_path,
        "moe_digits",
        capsys,
        "run.num_steps=2",
        "train.exact_on_policy=true",
        "engine.max_batch_size=7",
        "rollout.batch_size=4",
        "rollout.n_samples_per_prompt=4",
        "train.lr=0.01",
    )
    _assert_exact(steps, 2)
    for s in steps:
        assert s["train/moe/routing_agreement"] == 1.0
        assert s["train/moe/replay_agreement"] == 1.0


def test_default_run_differs(tmp_path, capsys):
    """The control: the same run without the setting has engine/trainer log-prob differences."""
    steps = _run(
        tmp_path,
        "reverse_digits",
        capsys,
        "run.num_steps=2",
        "rollout.batch_size=4",
        "rollout.n_samples_per_prompt=4",
    )
    assert any(s["train/logprob_mismatch_max"] > 0 for s in steps)
    assert all("rollout/mismatch_tokens" not in s for s in steps)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (
            ['engine={type = "sglang", urls = ["http://127.0.0.1:1"]}'],
            "computes its log-probs with its own kernels",
        ),
        (["engine.dtype=bfloat16"], "engine.dtype='bfloat16'"),
        (["train.dtype=bfloat16"], "train.dtype='bfloat16'"),
        (["train.lora={rank = 4, dropout = 0.1}"], "train.lora.dropout=0.1"),
        (['engine.speculative={type = "ngram"}'], "engine.speculative.type='ngram'"),
    ],
)
def test_refused_where_it_cannot_hold(tmp_path, capsys, overrides, fragment):
    run = tmp_path / "refused"
    code = main(
        [
            "train",
            str(EXAMPLES / "reverse_digits" / "config.toml"),
            f'run.output_dir="{run}"',
            "train.exact_on_policy=true",
            *overrides,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and not run.exists()
    lines = [line for line in err.splitlines() if "train.exact_on_policy" in line]
    assert lines and any(fragment in line for line in err.splitlines()), err


def test_uncovered_moe_family_is_refused(tmp_path, capsys):
    """Qwen2-MoE (a sigmoid-gated shared expert) is not among the covered MoE families."""
    import transformers

    from verst.rollout.toy import decoder_fields

    model = tmp_path / "qwen2_moe"
    transformers.Qwen2MoeConfig(**decoder_fields(64), num_experts=4, num_experts_per_tok=2).save_pretrained(
        model
    )
    run = tmp_path / "refused"
    code = main(
        [
            "train",
            str(EXAMPLES / "reverse_digits" / "config.toml"),
            f'run.output_dir="{run}"',
            "train.exact_on_policy=true",
            f'train.model_path="{model}"',
            "engine.model_path=null",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and not run.exists()
    assert any(
        "train.exact_on_policy" in line and "'qwen2_moe' is not covered" in line for line in err.splitlines()
    ), err


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("sharing", [True, False])
def test_reverse_digits_exact_across_batch_sizes_and_prefix_sharing(tmp_path, capsys, batch, sharing):
    n = 150 if (batch, sharing) == (64, True) else 10  # the whole example run once
    steps = _run(
        tmp_path,
        "reverse_digits",
        capsys,
        f"run.num_steps={n}",
        "train.exact_on_policy=true",
        f"engine.max_batch_size={batch}",
        f"engine.prefix_sharing={str(sharing).lower()}",
    )
    _assert_exact(steps, n)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_tool_math_multi_turn_exact(tmp_path, capsys, batch):
    steps = _run(
        tmp_path,
        "tool_math",
        capsys,
        "run.num_steps=3",
        "train.exact_on_policy=true",
        f"engine.max_batch_size={batch}",
        "rollout.batch_size=4",
    )
    _assert_exact(steps, 3)
