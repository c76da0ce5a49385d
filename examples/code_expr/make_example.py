"""Rebuild everything the code-expression example ships, deterministically.

Why: the example must not download anything, so the project makes its own task data, its own
char tokenizer, its own tiny Llama, and the SFT warm start that GRPO then improves.

The task: write a Python expression `f(x)` from input/output examples. Each hidden function is
`x*a+b` with `a` in [1, 99] and `b` in [0, 9]; the prompt shows it at x = 0, 1 and 10,

    "f(0)=3,f(1)=10,f(10)=73,f(x)="   ->   "x*7+3"   (then EOS)

and the answer is checked by running it in the sandbox against hidden tests at other inputs
(`code_tests`: `def f(x): return <answer>` plus `assert f(2) == 17`, ...). Any expression that
computes the function passes (`7*x+3`, `3+x*7`); the examples pin `b` (f(0)) and `a` (f(10) is
the digits of `a` then `b`).

1. `data/train.jsonl` (800 functions), `data/eval.jsonl` (190 held-out functions, disjoint);
2. `data/sft.jsonl`: 38,400 rows (600 steps x batch 64) of the *mixed-rule* warm start: the target
   is the right expression with probability 0.3, otherwise the swapped one `x*b+a` (wrong unless
   a == b) — greedy it writes the swap, sampled it is right ~30% of the time, which GRPO selects;
3. `model/init/`: the char tokenizer (the toy tokenizer's characters plus `_`) and a randomly
   initialised Llama (hidden 128, 4 layers, 4 heads, seed 0);
4. `model/warm_start/`: `verst sft sft.toml` (600 steps, AdamW 1e-3, batch 64) from `model/init`.

Run from the repository root:

    uv run python examples/code_expr/make_example.py          # everything (~1-3 min)
    uv run python examples/code_expr/make_example.py --no-sft # data + init model only
    uv run verst eval examples/code_expr/config.toml           # held-out pass rate of the warm start
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 20261206
N_EVAL = 190
SFT_STEPS, SFT_BATCH = 600, 64
RIGHT_PROB = 0.3
SHOWN = (0, 1, 10)
"""Inputs the prompt shows."""
HIDDEN = (2, 3, 7, -4, 13)
"""Inputs of the hidden tests (never shown)."""
PREFIX = "def f(x):\n    return "
"""The code the answer completes (as HumanEval's prompt is completed by the body)."""


def prompt(a: int, b: int) -> str:
    """The I/O examples of `x*a+b` and the open `f(x)=`."""
    return ",".join(f"f({x})={x * a + b}" for x in SHOWN) + ",f(x)="


def answer(a: int, b: int) -> str:
    """The canonical expression."""
    return f"x*{a}+{b}"


def row(a: int, b: int) -> dict:
    """One prompt row: the hidden tests are the label (code_tests' assert form)."""
    tests = [f"assert f({x}) == {x * a + b}" for x in HIDDEN]
    return {"prompt": prompt(a, b), "label": {"prefix": PREFIX, "tests": tests}, "answer": answer(a, b)}


def make_data(out: Path) -> None:
    """Write train/eval/sft JSONL files (deterministic)."""
    rng = random.Random(SEED)
    out.mkdir(parents=True, exist_ok=True)
    functions = [(a, b) for a in range(1, 100) for b in range(10)]
    rng.shuffle(functions)
    held_out, train = functions[:N_EVAL], functions[N_EVAL:]
    for name, items in (("train", train), ("eval", held_out)):
        with open(out / f"{name}.jsonl", "w") as f:
            for a, b in items:
                f.write(json.dumps(row(a, b)) + "\n")
    with open(out / "sft.jsonl", "w") as f:
        for _ in range(SFT_STEPS * SFT_BATCH):
            a, b = rng.choice(train)
            target = answer(a, b) if rng.random() < RIGHT_PROB else answer(b, a)
            f.write(json.dumps({"prompt": prompt(a, b), "response": target}) + "\n")


def make_init_model(out: Path) -> None:
    """Save the char tokenizer (with `_`) and the randomly initialised tiny Llama."""
    from verst.rollout.toy import CHARS, build_char_tokenizer, build_tiny_llama

    tokenizer = build_char_tokenizer(CHARS + "_")
    model = build_tiny_llama(
        len(tokenizer),
        seed=0,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
    )
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-sft", action="store_true", help="only write data and the initial model")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    make_data(HERE / "data")
    make_init_model(HERE / "model" / "init")
    if args.no_sft:
        return
    from verst.trainer.train.sft import load_sft_config, run_sft

    cfg = load_sft_config(HERE / "sft.toml")
    summary = run_sft(
        cfg, log=lambda step, m: print(f"sft step {step}: loss {m['sft/loss']:.4f}", flush=True)
    )
    print(f"sft done in {summary['seconds']:.0f}s, final loss {summary['final_loss']:.4f}")
    print("held-out pass rate of the warm start: uv run verst eval examples/code_expr/config.toml")


if __name__ == "__main__":
    main()
