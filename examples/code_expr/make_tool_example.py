"""Rebuild the multi-turn variant of the code-expression example: the model may run a candidate
in the sandbox with the `python` tool, sees its output (loss-masked), then answers.

An episode (`config_tool.toml`, the built-in tool environment with the `python` tool):

    f(0)=3,f(1)=10,f(10)=73,f(x)=
    <tool_call>{"name":"python","arguments":{"code":"f=lambda x:x*3+7;print(f(0),f(1),f(10))"}}</tool_call>
    <tool_response>7 10 37\n</tool_response>          (the sandbox's stdout; loss mask 0)
    x*7+3<eos>                                           (the answer, checked by code_tests)

1. the same train/eval prompts as the single-turn example (`make_example.py`);
2. `data/tool_sft.jsonl`: 38,400 rows (600 steps x batch 64), one model turn each: half are first
   turns — with probability 0.3 a tool call testing a candidate (the right expression or the
   swapped one, half each), otherwise a direct answer from the single-turn mixture (right 0.3,
   swapped 0.7) — and half are second turns: prompt + call + the candidate's real output →
   the right expression (when the output disagrees with the examples, the other candidate);
3. `model/tool_init/`: the char tokenizer plus the tool format's fixed strings as single tokens
   (`TOOL_TOKENS`) and a randomly initialised Llama (hidden 128, 4 layers, 4 heads, seed 0);
4. `model/tool_warm_start/`: `verst sft tool_sft.toml` from `model/tool_init`.

    uv run python examples/code_expr/make_tool_example.py          # everything (~2-5 min)
    uv run verst eval examples/code_expr/config_tool.toml           # held-out eval of the warm start
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from make_example import SFT_BATCH, SFT_STEPS, SHOWN, answer, make_data, prompt

HERE = Path(__file__).resolve().parent
SEED = 20261207
TOOL_PROB = 0.3
RIGHT_PROB = 0.3
CALL_HEAD = '{"name":"python","arguments":{"code":"f=lambda x:'
CALL_TAIL = ';print(f(0),f(1),f(10))"}}'
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", CALL_HEAD, CALL_TAIL)
"""Strings the tokenizer holds as single tokens (the fixed parts of a call and a response)."""


def tool_call(expr: str) -> str:
    """The model's call that runs `expr` at the shown inputs."""
    return f"<tool_call>{CALL_HEAD}{expr}{CALL_TAIL}</tool_call>"


def tool_response(a: int, b: int) -> str:
    """What the `python` tool returns for the candidate `x*a+b`: its stdout."""
    return "<tool_response>" + " ".join(str(x * a + b) for x in SHOWN) + "\n</tool_response>"


def make_tool_sft(out: Path) -> None:
    """Write `tool_sft.jsonl` (deterministic) from the train prompts of `make_data`."""
    rng = random.Random(SEED)
    train = [json.loads(line) for line in (out / "train.jsonl").open()]
    params = [tuple(int(v) for v in r["answer"][2:].split("+")) for r in train]
    with open(out / "tool_sft.jsonl", "w") as f:
        for i in range(SFT_STEPS * SFT_BATCH):
            a, b = rng.choice(params)
            text = prompt(a, b)
            cand = (a, b) if rng.random() < 0.5 else (b, a)
            if i % 2 == 0:  # first turn: test a candidate, or answer directly
                if rng.random() < TOOL_PROB:
                    response = tool_call(answer(*cand))
                else:
                    response = answer(a, b) if rng.random() < RIGHT_PROB else answer(b, a)
            else:  # second turn: the output shows whether the candidate was right
                text += tool_call(answer(*cand)) + tool_response(*cand)
                response = answer(a, b)
            f.write(json.dumps({"prompt": text, "response": response}) + "\n")


def make_tool_init_model(out: Path) -> None:
    """Save the char tokenizer with the tool tokens and the randomly initialised tiny Llama."""
    from verst.rollout.toy import CHARS, build_char_tokenizer, build_tiny_llama

    tokenizer = build_char_tokenizer(CHARS + "_")
    tokenizer.add_tokens(list(TOOL_TOKENS))
    model = build_tiny_llama(
        len(tokenizer),
        seed=0,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
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

    torch.set_num_threads(2)
    make_data(HERE / "data")
    make_tool_sft(HERE / "data")
    make_tool_init_model(HERE / "model" / "tool_init")
    if args.no_sft:
        return
    from verst.trainer.train.sft import load_sft_config, run_sft

    cfg = load_sft_config(HERE / "tool_sft.toml")
    summary = run_sft(
        cfg, log=lambda step, m: print(f"sft step {step}: loss {m['sft/loss']:.4f}", flush=True)
    )
    print(f"sft done in {summary['seconds']:.0f}s, final loss {summary['final_loss']:.4f}")
    print("held-out eval of the warm start: uv run verst eval examples/code_expr/config_tool.toml")


if __name__ == "__main__":
    main()
