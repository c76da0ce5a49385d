"""The LoRA variant of the example: `verst train examples/reverse_digits/lora.toml`, then
`verst export RUN_DIR --merge`.

Slow (about 2–4 minutes on 2 CPU cores): run with `uv run pytest -m slow tests/e2e`. Checks the
same promise as the full-fine-tuning example — held-out greedy eval reward +0.3 within 10
minutes — with only a rank-8 adapter trained, adapter-only refits and checkpoints, and that the
merged export loads with `from_pretrained`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from verst.trainer.cli import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reverse_digits"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lora_example_raises_eval_reward_by_at_least_0_3(tmp_path, capsys):
    run = tmp_path / "run"
    start = time.monotonic()
    code = main(["train", str(EXAMPLE / "lora.toml"), f'run.output_dir="{run}"'])
    elapsed = time.monotonic() - start
    assert code == 0, capsys.readouterr().err
    summary = json.loads((run / "summary.json").read_text())
    print(
        f"eval {summary['initial_eval_reward']:.3f} -> {summary['final_eval_reward']:.3f} in {elapsed:.0f}s"
    )
    assert summary["final_eval_reward"] - summary["initial_eval_reward"] >= 0.3
    assert elapsed < 600
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    full_bytes = (EXAMPLE / "model" / "warm_start" / "model.safetensors").stat().st_size
    sync = [m["sync/bytes"] for m in metrics if "sync/bytes" in m]
    assert sync and max(sync) < full_bytes / 5  # the adapter, not the model

    assert main(["export", str(run), "--merge"]) == 0
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run / "export" / "merged")
