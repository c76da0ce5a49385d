"""Rebuild everything the tool-math example ships, deterministically.

Why: a tiny model cannot multiply two 3-digit numbers, but it can learn to call a `multiply`
tool and copy the result. The example must not download anything, so the project makes its own
task data, tokenizer, tiny Llama and the SFT warm start that GRPO then improves:

1. `data/train.jsonl` (4,000 prompts), `data/eval.jsonl` (200 held-out prompts), each row
   `{"prompt": "123*456=", "label": "56088"}` — factors in [100, 999], disjoint sets;
2. `data/sft.jsonl`: 38,400 rows (600 steps × batch 64), one model turn each (loss on the
   turn only): half are first turns — the tool call
   `<tool_call>{"name":"multiply","arguments":{"a":123,"b":456}}</tool_call>` with probability
   0.3, otherwise a direct answer (the true product, which the model cannot learn) — and half
   are second turns (conversation + `<tool_response>56088</tool_response>` → `56088`);
3. `model/init/`: a char tokenizer (the toy tokenizer's characters plus `_`) with the tool
   format's fixed strings as single tokens (`TOOL_TOKENS`, as real tokenizers have
   `<tool_call>` tokens and BPE merges for common JSON), vocab 72, so a whole episode is ~30
   tokens; and a randomly initialised Llama (hidden 128, 4 layers, 4 heads, seed 0);
4. `model/warm_start/`: `verst sft sft.toml` (600 steps, AdamW 1e-3, batch 64) from `model/init`.

Greedy, the warm start answers directly (p = 0.7 > 0.3) and is almost always wrong; sampled, it
calls the tool about 30% of the time — which GRPO then selects.

Run from the repository root:

    uv run python examples/tool_math/make_example.py           # everything (~2–5 min)
    uv run python examples/tool_math/make_example.py --no-sft  # data + init model only
    uv run verst eval examples/tool_math/config.toml            # held-out eval of the warm start
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 20261201
N_TRAIN, N_EVAL = 4000, 200
SFT_STEPS, SFT_BATCH = 600, 64
TOOL_PROB = 0.3
TOOL_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    '{"name":"multiply","arguments":{"a":',
    ',"b":',
    "}}",
)
"""Strings the tokenizer holds as single tokens (the fixed parts of a call and a response)."""


def tool_call(a: int, b: int) -> str:
    """The exact text of the model's tool call (compact JSON)."""
    args = json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}}, separators=(",", ":"))
    return f"<tool_call>{args}</tool_call>"


def tool_response(result: int) -> str:
    """The observation the built-in tool environment appends for one call."""
    return f"<tool_response>{result}</tool_response>"


def _pair(rng: random.Random) -> tuple[int, int]:
    return rng.randint(100, 999), rng.randint(100, 999)


def make_data(out: Path) -> None:
    """Write train/eval/sft JSONL files (deterministic)."""
    rng = random.Random(SEED)
    out.mkdir(parents=True, exist_ok=True)
    seen: set[tuple[int, int]] = set()
    sets: dict[str, list[tuple[int, int]]] = {"eval": [], "train": []}
    for name, n in (("eval", N_EVAL), ("train", N_TRAIN)):
        while len(sets[name]) < n:
            p = _pair(rng)
            if p not in seen:
                seen.add(p)
                sets[name].append(p)
    for name, pairs in sets.items():
        with open(out / f"{name}.jsonl", "w") as f:
            for a, b in pairs:
                f.write(json.dumps({"prompt": f"{a}*{b}=", "label": str(a * b)}) + "\n")
    held_out = set(sets["eval"])
    with open(out / "sft.jsonl", "w") as f:
        for i in range(SFT_STEPS * SFT_BATCH):
            a, b = _pair(rng)
            while (a, b) in held_out:
                a, b = _pair(rng)
            prompt = f"{a}*{b}="
            if i % 2 == 0:  # first turn: call the tool, or answer directly
                response = tool_call(a, b) if rng.random() < TOOL_PROB else str(a * b)
            else:  # second turn: copy the tool's result
                prompt += tool_call(a, b) + tool_response(a * b)
                response = str(a * b)
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")


def make_init_model(out: Path) -> None:
    """Save the char tokenizer (with `_`) and the randomly initialised tiny Llama."""
    from verst.rollout.toy import CHARS, build_char_tokenizer, build_tiny_llama

    tokenizer = build_char_tokenizer(CHARS + "_")
    tokenizer.add_tokens(list(TOOL_TOKENS))
    model = build_tiny_llama(
        len(tokenizer),
        seed=0,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        max_position_embeddings=256,
    )
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-sft", action="store_true", help="only write data and the initial model")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
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
    print("held-out eval of the warm start: uv run verst eval examples/tool_math/config.toml")


if __name__ == "__main__":
    main()
