"""Rebuild everything the judge-digits example ships, deterministically.

The example trains a policy by GRPO whose only training reward is a *judge model*: a tiny
char-level Llama that the example makes and SFT-trains itself, asked "does this answer equal the
reference?" (a reference-based LLM-as-judge). The held-out set is scored by the true rule (exact
match), which the judge never sees. This script makes:

1. `data/train.jsonl` (4,000 prompts), `data/eval.jsonl` (300 held-out prompts), rows
   `{"prompt": "6048764=", "label": "4678406"}` (4–8 digits, disjoint sets);
2. `data/sft.jsonl`: the policy's mixed-rule warm start (reverse_digits' recipe with the
   reversal at probability 0.5 instead of 0.3, the unchanged copy otherwise; 600 steps × 64
   rows). At 0.3 the warm start's greedy exact match is 0.047 and GRPO against the judge did
   not learn from it (README.md); at 0.5 it is 0.197;
3. `data/judge_sft.jsonl` / `data/judge_eval.jsonl`: judge prompts `"<reference>:<answer>?"`
   with the target `y` or `n`; half positives (`<reference><eos>`), half near misses: one
   digit changed, two adjacent digits swapped, a digit dropped, a digit added, the prompt copied
   unreversed, truncated (a prefix that stopped), never stopped (the reference and more digits,
   cut at the policy's 12 tokens, no EOS), a random digit string. The judge's strings are
   disjoint from the held-out prompts (the judge never sees a held-out answer);
   `judge_eval.jsonl` (strings disjoint from both) carries each pair's `kind`. Half the
   positive SFT rows are `"<reference>:"` -> `"<reference><eos>?y"` (the answer is supervised
   too, so the judge learns the copy it compares against);
4. `model/init/` and `model/judge_init/`: the char tokenizer and two randomly initialised tiny
   Llamas (hidden 128, 4 layers, 4 heads, 0.67M parameters, seeds 0 and 1);
5. `model/warm_start/`: `verst sft sft.toml` (600 steps, lr 1e-3);
   `model/judge/`: `verst sft judge_sft.toml` (see the file for its steps and lr).

Run from the repository root:

    uv run python examples/judge_digits/make_example.py            # everything
    uv run python examples/judge_digits/make_example.py --no-sft   # data + init models only
    uv run python examples/judge_digits/make_example.py --measure  # only the evals below

It prints the policy's greedy held-out exact match (init, warm start) and the judge's held-out
accuracy per kind of answer (the verdict `y` when P(y) / (P(y) + P(n)) > 0.5) and mean score.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 20261207
N_TRAIN, N_EVAL = 4000, 300
SFT_STEPS, SFT_BATCH = 600, 64
REVERSE_PROB = 0.5
N_JUDGE_TRAIN, N_JUDGE_EVAL = 60_000, 4_000
MAX_RESPONSE_LEN = 12  # the policy's max_response_len (config.toml)
EOS = "<eos>"
NEGATIVE_KINDS = ("changed", "swapped", "dropped", "added", "copy", "truncated", "no_stop", "random")
TEMPLATE = "{label}:{response}?"
"""The judge prompt (config.toml's rollout.reward.judge.template); every character is in the
char tokenizer's vocabulary (checked below: an unknown one would encode as <unk>)."""


def _digits(rng: random.Random, lo: int = 4, hi: int = 8) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(lo, hi)))


def _other_digit(rng: random.Random, d: str) -> str:
    return rng.choice([c for c in "0123456789" if c != d])


def near_miss(rng: random.Random, prompt_digits: str, ref: str, kind: str) -> str:
    """A wrong answer of `kind` to the prompt whose reference is `ref` (response text as the
    policy's engine decodes it: digits, then `<eos>` when it stopped)."""
    if kind == "changed":
        i = rng.randrange(len(ref))
        return ref[:i] + _other_digit(rng, ref[i]) + ref[i + 1 :] + EOS
    if kind == "swapped":
        i = rng.randrange(len(ref) - 1)
        return ref[:i] + ref[i + 1] + ref[i] + ref[i + 2 :] + EOS
    if kind == "dropped":
        i = rng.randrange(len(ref))
        return ref[:i] + ref[i + 1 :] + EOS
    if kind == "added":
        i = rng.randrange(len(ref) + 1)
        return ref[:i] + rng.choice("0123456789") + ref[i:] + EOS
    if kind == "copy":
        return prompt_digits + EOS
    if kind == "truncated":
        return ref[: rng.randrange(0, len(ref))] + EOS
    if kind == "no_stop":
        return (ref + "".join(rng.choice("0123456789") for _ in range(MAX_RESPONSE_LEN)))[:MAX_RESPONSE_LEN]
    if kind == "random":
        return _digits(rng, 1, 9) + EOS
    raise ValueError(kind)


def judge_row(rng: random.Random, s: str, aux: bool = True) -> dict:
    """One judge SFT row for prompt digits `s`: a positive or a near miss (target y / n)."""
    ref = s[::-1]
    if rng.random() < 0.5:
        kind, answer = "correct", ref + EOS
    else:
        kind = rng.choice(NEGATIVE_KINDS)
        answer = near_miss(rng, s, ref, kind)
    ok = answer == ref + EOS  # e.g. the copy of a palindrome is right
    if ok:
        kind = "correct"
    prompt = TEMPLATE.format(label=ref, response=answer)
    if aux and ok and rng.random() < 0.5:
        # half the positives supervise the answer too: "<ref>:" -> "<ref><eos>?y". The judge
        # learns to write the reference after ':' (a copy), which makes comparing the answer
        # with it easy; with the verdict token alone it stalled at 0.82 held-out accuracy.
        return {"prompt": ref + ":", "response": answer + "?y", "kind": kind}
    return {"prompt": prompt, "response": "y" if ok else "n", "kind": kind}


def make_data(out: Path) -> None:
    """Write the policy's and the judge's JSONL files (deterministic)."""
    rng = random.Random(SEED)
    out.mkdir(parents=True, exist_ok=True)
    eval_set: list[str] = []
    seen: set[str] = set()
    while len(eval_set) < N_EVAL:
        s = _digits(rng)
        if s not in seen:
            seen.add(s)
            eval_set.append(s)
    held_out = set(eval_set)
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
            while s in held_out:
                s = _digits(rng)
            target = s[::-1] if rng.random() < REVERSE_PROB else s
            f.write(json.dumps({"prompt": f"{s}=", "response": target}) + "\n")
    # the judge: strings never in the held-out set; its eval strings in none of the others
    judge_train: list[dict] = []
    judge_seen: set[str] = set()
    while len(judge_train) < N_JUDGE_TRAIN:
        s = _digits(rng)
        if s in held_out:
            continue
        judge_seen.add(s)
        judge_train.append(judge_row(rng, s))
    judge_eval: list[dict] = []
    while len(judge_eval) < N_JUDGE_EVAL:
        s = _digits(rng)
        if s in held_out or s in judge_seen or s in seen:
            continue
        judge_eval.append(judge_row(rng, s, aux=False))
    for name, rows in (("judge_sft", judge_train), ("judge_eval", judge_eval)):
        with open(out / f"{name}.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


def check_template_vocab(model_dir: Path) -> None:
    """Every character of a judge prompt is one known token (no <unk>)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    sample = TEMPLATE.format(label="0123456789", response="9876543210" + EOS)
    ids = tok.encode(sample, add_special_tokens=False)
    assert tok.unk_token_id not in ids, f"{sample!r} has characters outside the tokenizer: {ids}"
    assert ids[-2] == tok.eos_token_id and len(ids) == len(sample) - len(EOS) + 1, ids
    for t in ("y", "n"):
        assert len(tok.encode(t, add_special_tokens=False)) == 1


def make_init_models(out: Path) -> None:
    """The char tokenizer and the randomly initialised tiny Llamas of the policy and the judge."""
    from verst.rollout.toy import make_tiny_checkpoint

    make_tiny_checkpoint(out / "init", seed=0, hidden_size=128, num_layers=4, num_heads=4)
    make_tiny_checkpoint(out / "judge_init", seed=1, hidden_size=128, num_layers=4, num_heads=4)
    check_template_vocab(out / "judge_init")


def greedy_exact_match(model_dir: Path, eval_path: Path) -> float:
    """Fraction of held-out prompts whose greedy answer is the reversal then EOS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in eval_path.read_text().splitlines() if line.strip()]
    right = 0
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
                max_new_tokens=MAX_RESPONSE_LEN,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        for row, seq in zip(chunk, out[:, width:].tolist(), strict=True):
            target = [*tok(row["label"], add_special_tokens=False)["input_ids"], tok.eos_token_id]
            right += seq[: len(target)] == target
    return right / len(rows)


def judge_scores(model_dir: Path, prompts: list[str]) -> list[float]:
    """P(y) / (P(y) + P(n)) at the first verdict position — what `yes_no_logprob` computes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    y, n = (tok.encode(t, add_special_tokens=False)[0] for t in ("y", "n"))
    scores: list[float] = []
    for i in range(0, len(prompts), 256):
        ids = [tok.encode(p, add_special_tokens=False) for p in prompts[i : i + 256]]
        width = max(map(len, ids))
        input_ids = torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in ids])  # [batch, seq]
        attention = (
            torch.arange(width)[None, :] >= torch.tensor([width - len(x) for x in ids])[:, None]
        ).long()
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids).logits[
                :, -1
            ]
        pair = torch.log_softmax(logits.float(), -1)[:, [y, n]]  # [batch, 2]
        scores.extend(torch.softmax(pair, -1)[:, 0].tolist())
    return scores


def judge_report(model_dir: Path, eval_path: Path) -> dict[str, dict[str, float]]:
    """Held-out judge accuracy and mean score per kind of answer."""
    rows = [json.loads(line) for line in eval_path.read_text().splitlines() if line.strip()]
    scores = judge_scores(model_dir, [r["prompt"] for r in rows])
    by_kind: dict[str, list[tuple[bool, float]]] = defaultdict(list)
    for r, s in zip(rows, scores, strict=True):
        by_kind[r["kind"]].append(((s > 0.5) == (r["response"] == "y"), s))
    report = {
        k: {
            "n": len(v),
            "accuracy": sum(a for a, _ in v) / len(v),
            "mean_score": sum(s for _, s in v) / len(v),
        }
        for k, v in sorted(by_kind.items())
    }
    report["all"] = {
        "n": len(rows),
        "accuracy": sum(a for v in by_kind.values() for a, _ in v) / len(rows),
        "mean_score": sum(scores) / len(rows),
    }
    return report


def print_judge_report(report: dict[str, dict[str, float]]) -> None:
    for kind, m in report.items():
        print(
            f"judge held-out {kind:>9}: n {m['n']:4d}  accuracy {m['accuracy']:.3f}  mean score {m['mean_score']:.3f}"
        )


def sft(toml: str) -> Path:
    from verst.trainer.train.sft import load_sft_config, run_sft

    cfg = load_sft_config(HERE / toml)
    summary = run_sft(
        cfg, log=lambda step, m: print(f"{toml} step {step}: loss {m['sft/loss']:.4f}", flush=True)
    )
    print(f"{toml} done in {summary['seconds']:.0f}s, final loss {summary['final_loss']:.4f}", flush=True)
    return Path(cfg.output_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-sft", action="store_true", help="only write data and the initial models")
    parser.add_argument("--measure", action="store_true", help="only measure the shipped checkpoints")
    parser.add_argument("--only", choices=("policy", "judge"), help="SFT only this one")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    data, model = HERE / "data", HERE / "model"
    if not args.measure:
        make_data(data)
        make_init_models(model)
        if args.no_sft:
            return
        if args.only != "judge":
            sft("sft.toml")
        if args.only != "policy":
            sft("judge_sft.toml")
    if (model / "warm_start").exists():
        print(
            f"policy warm start greedy held-out exact match: {greedy_exact_match(model / 'warm_start', data / 'eval.jsonl'):.3f}"
        )
    if (model / "judge").exists():
        print_judge_report(judge_report(model / "judge", data / "judge_eval.jsonl"))


if __name__ == "__main__":
    main()
