"""Rebuild the MoE example's models, deterministically: a tiny Qwen3-MoE and its SFT warm start.

Why: the MoE example must not download anything, so the project makes its own mixture-of-experts
model (`verst.rollout.toy_moe`: 8 experts, top-2 routing, hidden 128, 2 layers, ~0.6M parameters,
the character tokenizer of the reverse-digits example) and warm-starts it with the reverse-digits
mixed-rule SFT data (`../reverse_digits/data/sft.jsonl`: the reversal with probability 0.3, else
the copy), so that GRPO with routing replay then has something to select.

1. `model/init/`: the randomly initialised tiny MoE (seed 0);
2. `model/warm_start/`: `verst sft sft.toml` (600 steps, AdamW 2e-3, batch 64, one thread) from
   `model/init`, with the model's own load-balancing loss on (`router_aux_loss_coef` 0.01; off
   again in the saved warm start) (committed; `model/init/` is not: this script rebuilds it).

Run from the repository root (the reverse-digits data must exist; it is committed):

    uv run python examples/moe_digits/make_example.py

It prints the greedy held-out eval reward of both checkpoints.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
DIGITS = HERE.parent / "reverse_digits"


def _greedy_eval():  # the reverse-digits example's eval (plain transformers generate)
    spec = importlib.util.spec_from_file_location("rd_make", DIGITS / "make_example.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.greedy_eval


BALANCE_COEF = 0.01
"""Load-balancing loss of the SFT (transformers' own `router_aux_loss_coef`): without it the
warm start routes every token to the same 2 of the 8 experts."""


def _set_balance_loss(model_dir: Path, coef: float) -> None:
    """Turn the model's own load-balancing loss on (`coef` > 0: added to the SFT loss) or off."""
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(router_aux_loss_coef=coef, output_router_logits=coef > 0)
    cfg_path.write_text(json.dumps(cfg, indent=2))


def main() -> None:
    import torch

    from verst.rollout.toy_moe import make_tiny_moe_checkpoint
    from verst.trainer.train.sft import load_sft_config, run_sft

    torch.set_num_threads(1)
    greedy_eval = _greedy_eval()
    make_tiny_moe_checkpoint(HERE / "model" / "init", family="qwen3_moe", seed=0, num_layers=2)
    print(
        f"init greedy eval reward: {greedy_eval(HERE / 'model' / 'init', DIGITS / 'data' / 'eval.jsonl'):.3f}"
    )
    cfg = load_sft_config(HERE / "sft.toml")
    _set_balance_loss(HERE / "model" / "init", BALANCE_COEF)
    summary = run_sft(
        cfg, log=lambda step, m: print(f"sft step {step}: loss {m['sft/loss']:.4f}", flush=True)
    )
    print(f"sft done in {summary['seconds']:.0f}s, final loss {summary['final_loss']:.4f}")
    _set_balance_loss(Path(cfg.output_dir), 0.0)  # RL: the trainer's own [train.moe] decides
    score = greedy_eval(Path(cfg.output_dir), DIGITS / "data" / "eval.jsonl")
    print(f"warm-start greedy eval reward: {score:.3f}")


if __name__ == "__main__":
    main()
