"""Rebuild what the reasoning-gym example ships: its tokenizer, tiny model and SFT warm start.

Why: the example trains on reasoning-gym's `spell_backward` task (questions like
"Spell this word backward (example: sun -> nus): bliss", answer "ssilb") with a model the
project makes itself, so nothing is downloaded. The prompts themselves are not shipped: the
`reasoning_gym` data source generates them from a seed at run time. This script makes:

1. `data/sft.jsonl`: 38,400 rows (600 steps × batch 64) of the *mixed-rule* warm start, from
   reasoning-gym's own generator with a seed far from the training and eval seeds: the target
   is the reversed word with probability 0.3 and the unchanged word otherwise;
2. `model/init/`: a character tokenizer (the project's char set plus capital letters) with the
   task's instruction as one added token (as a BPE vocabulary merges a frequent phrase; it keeps
   prompts ~8 tokens long, so the example runs in minutes on 2 cores), vocab 91, and a randomly
   initialised Llama (hidden 128, 4 layers, 4 heads, ~0.68M parameters, seed 0);
3. `model/warm_start/`: `verst sft sft.toml` (600 steps, AdamW 1e-3, batch 64) from `model/init`.

Run from the repository root (needs `uv sync --extra reasoning-gym`, in the dev group already):

    uv run python examples/reasoning_gym/make_example.py           # everything (~2–5 min on 2 cores)
    uv run python examples/reasoning_gym/make_example.py --no-sft  # data + init model only
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SFT_SEED = 10_000_000
"""reasoning-gym seed of the SFT words (training uses seed 0, eval 1,000,000; items i use seed + i)."""
SFT_STEPS, SFT_BATCH = 600, 64
REVERSE_PROB = 0.3
TASK = {"min_word_len": 3, "max_word_len": 6}
"""spell_backward's config, as in config.toml."""
PROMPT = "{question}\n"
"""The prompt template, as in config.toml."""
INSTRUCTION = "Spell this word backward (example: sun -> nus): "
"""spell_backward's fixed question prefix: one token of the example's tokenizer."""


def make_sft_data(out: Path) -> None:
    """Write the mixed-rule SFT rows (deterministic)."""
    import reasoning_gym

    n = SFT_STEPS * SFT_BATCH
    ds = reasoning_gym.create_dataset("spell_backward", **TASK, seed=SFT_SEED, size=n)
    rng = random.Random(SFT_SEED)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sft.jsonl", "w") as f:
        for entry in ds:
            word = entry["metadata"]["word"]
            target = entry["answer"] if rng.random() < REVERSE_PROB else word
            f.write(
                json.dumps({"prompt": PROMPT.format(question=entry["question"]), "response": target}) + "\n"
            )


def make_init_model(out: Path) -> None:
    """Save the char tokenizer (with capitals) and the randomly initialised tiny Llama."""
    from verst.rollout.toy import CHARS, build_char_tokenizer, build_tiny_llama

    tok = build_char_tokenizer(CHARS + "ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    tok.add_tokens([INSTRUCTION])
    model = build_tiny_llama(
        len(tok),
        seed=0,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-sft", action="store_true", help="only write data and the initial model")
    args = parser.parse_args()
    make_sft_data(HERE / "data")
    make_init_model(HERE / "model" / "init")
    if args.no_sft:
        return
    from verst.trainer.train.sft import load_sft_config, run_sft

    cfg = load_sft_config(HERE / "sft.toml")
    summary = run_sft(
        cfg, log=lambda step, m: print(f"sft step {step}: loss {m['sft/loss']:.4f}", flush=True)
    )
    print(f"sft done in {summary['seconds']:.0f}s, final loss {summary['final_loss']:.4f}")
    print(
        "greedy eval of the warm start: uv run verst eval examples/reasoning_gym/config.toml "
        "examples/reasoning_gym/model/warm_start"
    )


if __name__ == "__main__":
    main()
