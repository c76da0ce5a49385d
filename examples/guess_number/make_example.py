"""Rebuild everything the guess-the-number example ships, deterministically.

Why: a truly multi-turn example — the environment answers every guess with "higher" or
"lower" and the model must use that feedback within `max_turns` guesses. Nothing is
downloaded: the project makes the data, the tokenizer, a tiny Llama and an SFT warm start.

1. `data/train.jsonl` (2,000 rows) and `data/eval.jsonl` (64 rows): `{"prompt": "guess 1-16:",
   "label": "11"}`, secrets uniform in 1..16 (the eval rows cover every secret 4 times);
2. `data/sft.jsonl`: 19,200 rows (300 steps × batch 64) of one guess each, after a random
   history of earlier guesses and their replies: with probability 0.5 the target guess is
   consistent with the replies so far (uniform in the interval still possible), otherwise
   uniform in 1..16 — so the warm start plays the format but only half-uses the feedback;
3. `model/init/`: the toy char tokenizer and a tiny Llama (hidden 128, 4 layers, seed 0);
4. `model/warm_start/`: `verst sft sft.toml` (300 steps, AdamW 1e-3, batch 64, 1 thread).

Run from the repository root:

    uv run python examples/guess_number/make_example.py   # everything (~1–3 min)
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 20261202
LOW, HIGH = 1, 16
PROMPT = f"guess {LOW}-{HIGH}:"
SFT_STEPS, SFT_BATCH = 300, 64
CONSISTENT_PROB = 0.5
EOS = "<eos>"


def make_data(out: Path) -> None:
    rng = random.Random(SEED)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.jsonl", "w") as f:
        for _ in range(2000):
            f.write(json.dumps({"prompt": PROMPT, "label": str(rng.randint(LOW, HIGH))}) + "\n")
    with open(out / "eval.jsonl", "w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": PROMPT, "label": str(LOW + i % (HIGH - LOW + 1))}) + "\n")
    with open(out / "sft.jsonl", "w") as f:
        for _ in range(SFT_STEPS * SFT_BATCH):
            secret = rng.randint(LOW, HIGH)
            lo, hi, history = LOW, HIGH, ""
            for _ in range(rng.randint(0, 3)):  # a random history of wrong guesses
                guess = rng.randint(lo, hi) if rng.random() < CONSISTENT_PROB else rng.randint(LOW, HIGH)
                if guess == secret:
                    break
                if guess < secret:
                    lo = max(lo, guess + 1)
                    history += f"{guess}{EOS} higher:"
                else:
                    hi = min(hi, guess - 1)
                    history += f"{guess}{EOS} lower:"
            target = rng.randint(lo, hi) if rng.random() < CONSISTENT_PROB else rng.randint(LOW, HIGH)
            f.write(json.dumps({"prompt": PROMPT + history, "response": str(target)}) + "\n")


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    import torch

    from verst.rollout.toy import make_tiny_checkpoint
    from verst.trainer.train.sft import load_sft_config, run_sft

    torch.set_num_threads(1)
    make_data(HERE / "data")
    make_tiny_checkpoint(HERE / "model" / "init", seed=0, hidden_size=128, num_layers=4, num_heads=4)
    cfg = load_sft_config(HERE / "sft.toml")
    summary = run_sft(
        cfg, log=lambda step, m: print(f"sft step {step}: loss {m['sft/loss']:.4f}", flush=True)
    )
    print(f"sft done in {summary['seconds']:.0f}s, final loss {summary['final_loss']:.4f}")


if __name__ == "__main__":
    main()
