"""Build the distillation example's student: a smaller tiny Llama, warm-started like reverse_digits.

Why: on-policy distillation needs a student that is smaller than its teacher. The teacher is the
reverse-digits example's GRPO-trained policy (hidden 128, 4 layers; `model/teacher/`, trained by
`verst train examples/reverse_digits/config.toml`, see README.md). The student is a Llama with
hidden 64, 2 layers, 2 heads (~0.1M parameters) and the same char tokenizer, given the same
kind of mixed-rule SFT warm start as the reverse-digits example (reversal with probability 0.3,
else the copy), so that it can already sample reversals which RL can select.

Run from the repository root:

    uv run python examples/distill/make_student.py      # model/student_init + model/student_warm_start

It prints the greedy held-out eval reward of the warm start.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
STUDENT = {"hidden_size": 64, "num_layers": 2, "num_heads": 2}
"""The student's architecture (the teacher's is hidden 128, 4 layers, 4 heads)."""


def main() -> None:
    import torch

    from verst.rollout.toy import make_tiny_checkpoint
    from verst.trainer.train.sft import load_sft_config, run_sft

    torch.set_num_threads(2)
    make_tiny_checkpoint(HERE / "model" / "student_init", seed=0, **STUDENT)
    cfg = load_sft_config(HERE / "student_sft.toml")
    summary = run_sft(
        cfg, log=lambda step, m: print(f"sft step {step}: loss {m['sft/loss']:.4f}", flush=True)
    )
    print(f"sft done in {summary['seconds']:.0f}s, final loss {summary['final_loss']:.4f}")
    sys.path.insert(0, str(HERE.parent / "reverse_digits"))
    from make_example import greedy_eval

    score = greedy_eval(Path(cfg.output_dir), HERE.parent / "reverse_digits" / "data" / "eval.jsonl")
    print(f"student warm-start greedy eval reward: {score:.3f}")


if __name__ == "__main__":
    main()
