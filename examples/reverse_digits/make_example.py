"""Rebuild everything the reverse-digits example ships, deterministically.

Why: the example must not download anything, so the project makes its own task data, its own
tokenizer (a real Hugging Face `tokenizer.json`), its own tiny Llama, and the SFT warm start
that GRPO then improves. This script reproduces all of it:

1. `data/train.jsonl` (4,000 prompts), `data/eval.jsonl` (300 held-out prompts), each row
   `{"prompt": "6048764=", "label": "4678406"}` — digit strings of length 4–8, disjoint sets;
2. `data/sft.jsonl`: 38,400 rows (600 steps × batch 64) of the *mixed-rule* warm start: the
   target is the reversal with probability 0.3 and the unchanged copy otherwise;
3. `model/init/`: the char tokenizer (vocab 64) and a randomly initialised Llama
   (hidden 128, 4 layers, 4 heads, ~0.67M parameters, seed 0);
4. `model/warm_start/`: `verst sft sft.toml` (600 steps, AdamW 1e-3, batch 64) from `model/init`.

Run from the repository root:

    uv run python examples/reverse_digits/make_example.py          # everything (~1–2 min)
    uv run python examples/reverse_digits/make_example.py --no-sft # data + init model only

It prints the greedy held-out eval reward of the initial and the warm-start checkpoints.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 20261129
N_TRAIN, N_EVAL = 4000, 300
SFT_STEPS, SFT_BATCH = 600, 64
REVERSE_PROB = 0.3


def _digits(rng: random.Random) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(4, 8)))


def make_data(out: Path) -> None:
    """Write train/eval/sft JSONL files (deterministic)."""
    rng = random.Random(SEED)
    out.mkdir(parents=True, exist_ok=True)
    eval_set: list[str] = []
    seen: set[str] = set()
    while len(eval_set) < N_EVAL:
        s = _digits(rng)
        if s not in seen:
            seen.add(s)
            eval_set.append(s)
    train_set: list[str] = []
    while len(train_set) < N_TRAIN:
        s = _digits(rng)
        if s not in seen:
            seen.add(s)
            train_set.append(s)
    for name, items in (("train", train_set), ("eval", eval_set)):
        with open(out / f"{name}.jsonl", "w") as f:
            for s in items:
                f.write(json.dumps({"prompt": f"{s}=", "label": s[::-1]}) + "\n")
    with open(out / "sft.jsonl", "w") as f:
        for _ in range(SFT_STEPS * SFT_BATCH):
            s = _digits(rng)
            while s in eval_set:
                s = _digits(rng)
            target = s[::-1] if rng.random() < REVERSE_PROB else s
            f.write(json.dumps({"prompt": f"{s}=", "response": target}) + "\n")


def make_init_model(out: Path) -> None:
    """Save the char tokenizer and the randomly initialised tiny Llama."""
    from verst.rollout.toy import make_tiny_checkpoint

    make_tiny_checkpoint(out, seed=0, hidden_size=128, num_layers=4, num_heads=4)


def greedy_eval(model_dir: Path, eval_path: Path, max_new_tokens: int = 12) -> float:
    """Mean partial-credit reward of greedy completions on the eval set (plain `generate`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in eval_path.read_text().splitlines() if line.strip()]
    total = 0.0
    for i in range(0, len(rows), 100):
        chunk = rows[i : i + 100]
        ids = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in chunk]
        width = max(map(len, ids))
        input_ids = torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in ids])  # [batch, seq]
        attention = (
            torch.arange(width)[None, :] >= torch.tensor([width - len(x) for x in ids])[:, None]
        ).long()
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        for row, seq in zip(chunk, out[:, width:].tolist(), strict=True):
            target = [*tok(row["label"], add_special_tokens=False)["input_ids"], tok.eos_token_id]
            total += sum(a == b for a, b in zip(seq, target, strict=False)) / len(target)
    return total / len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-sft", action="store_true", help="only write data and the initial model")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    make_data(HERE / "data")
    make_init_model(HERE / "model" / "init")
    print(
        f"init greedy eval reward: {greedy_eval(HERE / 'model' / 'init', HERE / 'data' / 'eval.jsonl'):.3f}"
    )
    if args.no_sft:
        return
    from verst.trainer.train.sft import load_sft_config, run_sft

    cfg = load_sft_config(HERE / "sft.toml")
    summary = run_sft(
        cfg, log=lambda step, m: print(f"sft step {step}: loss {m['sft/loss']:.4f}", flush=True)
    )
    print(f"sft done in {summary['seconds']:.0f}s, final loss {summary['final_loss']:.4f}")
    score = greedy_eval(Path(cfg.output_dir), HERE / "data" / "eval.jsonl")
    print(f"warm-start greedy eval reward: {score:.3f}")


if __name__ == "__main__":
    main()
