"""verst vs TRL's GRPOTrainer on the reverse-digits example, and both vs the fair compute floor.

Why: at tiny scale a GRPO step is mostly framework overhead, so this is where an RL framework's
own cost shows. verst should be faster than TRL, within 1.1× of the fair floor (issue #29's
target), and learn at least as well in the same number of steps.

Both sides get the same model (the example's SFT warm start), task and prompts, group size (8),
batch (8 prompts × 8 completions = 64 sequences, one forward/backward, one optimizer step per
step), max new tokens (12), temperature 1.0 (no top-k / top-p), lr 1e-4 constant, AdamW
(betas 0.9/0.999, eps 1e-8, weight decay 0), grad-norm clip 1.0, no KL, PPO clip 0.2, one
update per batch, the same reward (partial credit over digits + EOS,
`examples/reverse_digits/reverse_digits_reward.py`), float32 on CPU, the same torch thread
count; loss aggregation token-mean over the whole batch (TRL `loss_type="dapo"`, verst
`loss_agg="token_mean"`) and group-std advantage normalisation (TRL `scale_rewards="group"`,
verst `normalize_std=true`). Two references are measured in the same run:
- the **fair floor** (`fair_floor.py`): only the work the job needs — each distinct prompt
  prefilled once, decode of the live rows on an unrepeated KV cache, a train forward over each
  prompt once plus every response token once with the LM head on response positions only, the
  backward, one fused AdamW step. `verst_over_floor` is verst's step over this floor, measured
  just before and just after verst's run (their mean: the box's speed drifts);
- the **plain HF baseline** (what this benchmark called its floor before): `model.generate` of the
  left-padded batch, one forward+backward over the padded rows, one fused AdamW step.
  `verst_over_hf_plain` is verst's step over it. Step times are medians over the steps of each run after `--warmup` steps, then
the median over `--runs` runs; eval rewards are greedy on the 300 held-out prompts, medians
over runs.

Run (TRL lives in the `bench` dependency group):

    uv run --group bench python benchmarks/vs_trl.py            # ~5–8 min on 2 cores
    uv run --group bench python benchmarks/vs_trl.py --steps 20 --runs 1   # quick look

Last line: `trl_over_verst_step_time=<r> verst_over_floor=<r> verst_eval_reward=<x>
trl_eval_reward=<y> verst_over_hf_plain=<r>` (one line).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "reverse_digits"
MODEL = EXAMPLE / "model" / "warm_start"
PROMPTS, GROUP, MAX_NEW, LR, CLIP = 8, 8, 12, 1e-4, 0.2


def rows(name: str) -> list[dict[str, str]]:
    return [json.loads(line) for line in (EXAMPLE / "data" / name).read_text().splitlines() if line.strip()]


def left_pad(ids: list[list[int]], pad: int) -> tuple[Any, Any]:
    """Token-id lists → (`[batch, width]` left-padded ids, `[batch, width]` mask, 1 = real token),
    the layout `generate` takes."""
    import torch

    width = max(map(len, ids))
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    attention = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    return input_ids, attention


def verst_overrides(tmp: str, steps: int, threads: int, seed: int) -> list[str]:
    """verst's overrides of the example config for this benchmark (also `train_step_phases.py`'s)."""
    return [
        f"run.num_steps={steps}",
        f'run.output_dir="{tmp}"',
        "run.save_interval=0",
        "run.resume=false",
        f"run.seed={seed}",
        f"rollout.seed={seed}",
        f"train.seed={seed}",
        f"rollout.batch_size={PROMPTS}",
        f"rollout.n_samples_per_prompt={GROUP}",
        f"rollout.max_response_len={MAX_NEW}",
        "rollout.temperature=1.0",
        "rollout.eval.datasets={}",
        f"train.lr={LR}",
        f"train.num_threads={threads}",
        f"engine.num_threads={threads}",
        "train.micro_batch_size=64",
        'algorithm.loss_agg="token_mean"',
        f"algorithm.policy_loss.eps_clip_low={CLIP}",
        f"algorithm.policy_loss.eps_clip_high={CLIP}",
        "algorithm.kl_coef=0.0",
    ]


def greedy_eval(model: Any, tok: Any, eval_rows: list[dict[str, str]]) -> float:
    """Mean reward of greedy completions (digits + EOS partial credit) on the eval rows."""
    import torch

    sys.path.insert(0, str(EXAMPLE))
    from reverse_digits_reward import score

    model.eval()
    total = 0.0
    for i in range(0, len(eval_rows), 100):
        chunk = eval_rows[i : i + 100]
        ids = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in chunk]
        input_ids, attention = left_pad(ids, tok.pad_token_id)  # [batch, width] each
        width = input_ids.shape[1]
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                max_new_tokens=MAX_NEW,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        for row, seq in zip(chunk, out[:, width:].tolist(), strict=True):
            stopped = tok.eos_token_id in seq
            seq = seq[: seq.index(tok.eos_token_id)] if stopped else seq
            total += score(tok.decode(seq), row["label"], stopped)
    return total / len(eval_rows)


# ---------------------------------------------------------------- verst


def run_verst(
    seed: int, steps: int, threads: int, eval_rows: list[dict[str, str]]
) -> tuple[list[float], float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verst.rollout.selection import resolve_extra_env_vars
    from verst.trainer.cli import add_config_dir_to_path, resolve_paths
    from verst.trainer.config import load_run_config
    from verst.trainer.run.controller import InMemoryLogger, run_training

    with tempfile.TemporaryDirectory() as tmp:
        overrides = verst_overrides(tmp, steps, threads, seed)
        cfg = resolve_paths(load_run_config(EXAMPLE / "config.toml", overrides), EXAMPLE / "config.toml")
        add_config_dir_to_path(EXAMPLE / "config.toml")
        logger = InMemoryLogger()
        run_training(cfg, tmp, env=resolve_extra_env_vars(cfg.run.env), logger=logger)
        times = [m["time/step_s"] for _, m in logger.records if "time/step_s" in m]
        final = Path(tmp) / "checkpoints" / f"step_{steps}" / "model"
        model = AutoModelForCausalLM.from_pretrained(final)
        tok = AutoTokenizer.from_pretrained(final)
        return times, greedy_eval(model, tok, eval_rows)


# ---------------------------------------------------------------- TRL

TRL_SAME_AS_VERST: dict[str, Any] = dict(
    temperature=1.0, top_k=0, top_p=1.0,  # no truncation
    lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
    beta=0.0, epsilon=CLIP, loss_type="dapo", scale_rewards="group", num_iterations=1,
    use_cpu=True, bf16=False, gradient_checkpointing=False,
    report_to="none", save_strategy="no", logging_steps=10_000, disable_tqdm=True,
)  # fmt: skip
"""`GRPOConfig` settings that match verst's side (both benchmarks): sampling, schedule, loss,
one update per batch, float32 on CPU, no logging."""


def run_trl(seed: int, steps: int, eval_rows: list[dict[str, str]]) -> tuple[list[float], float]:
    try:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ModuleNotFoundError as exc:
        if exc.name not in ("trl", "datasets"):
            raise
        raise SystemExit(
            "TRL is in the bench group: `uv run --group bench python benchmarks/vs_trl.py`"
        ) from None
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    sys.path.insert(0, str(EXAMPLE))
    from reverse_digits_reward import score

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    eos = tok.eos_token_id

    def reward(prompts, completions, completion_ids, label, **_: Any) -> list[float]:
        out = []
        for ids, lab in zip(completion_ids, label, strict=True):
            stopped = bool(ids) and ids[-1] == eos
            digits = tok.decode(ids[:-1] if stopped else ids, skip_special_tokens=True)
            out.append(score(digits, lab, stopped))
        return out

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._t = 0.0

        def on_step_begin(self, args, state, control, **kw):
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self._t)

    timer = StepTimer()
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=PROMPTS * GROUP,
            num_generations=GROUP,
            max_completion_length=MAX_NEW,
            learning_rate=LR,
            max_steps=steps,
            seed=seed,
            **TRL_SAME_AS_VERST,
        )
        dataset = Dataset.from_list(rows("train.jsonl"))
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=dataset,
            processing_class=tok,
            callbacks=[timer],
        )
        trainer.train()
        return timer.times, greedy_eval(trainer.model, tok, eval_rows)


# ---------------------------------------------------------------- the references


def batches(repeats: int, seed: int, tok: Any) -> list[list[list[int]]]:
    """`repeats` batches of PROMPTS distinct prompts' ids (the floor's draws)."""
    import random

    train, rng = rows("train.jsonl"), random.Random(seed)
    return [
        [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rng.sample(train, PROMPTS)]
        for _ in range(repeats)
    ]


def measure_fair_floor(repeats: int, seed: int) -> dict[str, float]:
    """Medians of the fair floor's phases (`fair_floor.py`), after one checked warm-up step."""
    import torch
    from fair_floor import FairFloor, check_against_hf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    draws = batches(repeats + 1, seed, tok)
    check_against_hf(model, draws[0][:2], 2, MAX_NEW, tok.eos_token_id, tok.pad_token_id)
    torch.manual_seed(seed)
    floor = FairFloor(model, lr=LR)
    floor.step(draws[0], GROUP, MAX_NEW, tok.eos_token_id)  # warm-up (AdamW state, allocations)
    steps = [floor.step(b, GROUP, MAX_NEW, tok.eos_token_id) for b in draws[1:]]
    return {k: statistics.median(s[k] for s in steps) for k in steps[0]}


def measure_hf_plain(repeats: int, seed: int) -> dict[str, float]:
    """The plain HF baseline: medians of generate the padded batch, one forward+backward over
    it, one AdamW step."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    gen, fwd_bwd, step = [], [], []
    for prompts in batches(repeats, seed, tok):
        batch = [p for p in prompts for _ in range(GROUP)]  # drawn as the fair floor draws its prompts
        input_ids, attention = left_pad(batch, tok.pad_token_id)  # [batch, width] each
        width = input_ids.shape[1]
        model.eval()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                max_new_tokens=MAX_NEW,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )  # [batch, seq + new]
        t1 = time.perf_counter()
        model.train()
        completion = out[:, width:]  # [batch, new]
        mask = (completion != tok.pad_token_id).float()  # [batch, new]
        full_attention = torch.cat([attention, mask.long()], dim=1)  # [batch, seq + new]
        logits = model(input_ids=out, attention_mask=full_attention).logits[
            :, width - 1 : -1
        ]  # [batch, new, vocab]
        logp = (
            torch.log_softmax(logits.float(), -1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        )  # [batch, new]
        advantages = torch.randn(len(batch), 1)  # [batch, 1]
        loss = -(advantages * logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        t3 = time.perf_counter()
        gen.append(t1 - t0)
        fwd_bwd.append(t2 - t1)
        step.append(t3 - t2)
    return {
        "generate_s": statistics.median(gen),
        "forward_backward_s": statistics.median(fwd_bwd),
        "optimizer_s": statistics.median(step),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="GRPO steps per run (both sides)")
    parser.add_argument("--runs", type=int, default=2, help="runs per side (seeds 0..runs-1)")
    parser.add_argument("--warmup", type=int, default=3, help="steps excluded from the step-time median")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (both sides; 1 is faster for both on 2 cores)"
    )
    parser.add_argument("--floor-repeats", type=int, default=20)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    eval_rows = rows("eval.jsonl")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start_eval = greedy_eval(
        AutoModelForCausalLM.from_pretrained(MODEL), AutoTokenizer.from_pretrained(MODEL), eval_rows
    )
    print(f"warm start greedy eval reward: {start_eval:.3f}", flush=True)
    verst_steps, trl_steps, floors, plains, verst_evals, trl_evals = [], [], [], [], [], []
    for seed in range(args.runs):  # references, verst, TRL back to back: load drift hits all alike
        for name, measure, into in (
            ("fair floor", measure_fair_floor, floors),
            ("hf plain", measure_hf_plain, plains),
        ):
            parts = measure(args.floor_repeats, seed=seed)
            into.append(sum(parts.values()))
            print(
                f"{name} run {seed}: "
                + " ".join(f"{k}={v * 1e3:.1f}ms" for k, v in parts.items())
                + f" total={into[-1] * 1e3:.1f}ms",
                flush=True,
            )
        times, ev = run_verst(seed, args.steps, args.threads, eval_rows)
        verst_steps.append(statistics.median(times[args.warmup :]))
        verst_evals.append(ev)
        print(f"verst run {seed}: median step {verst_steps[-1] * 1e3:.1f} ms, eval {ev:.3f}", flush=True)
        # the floor again right after verst: the box's speed drifts (1.5x within an hour seen), so
        # verst is compared with the mean of the floors measured just before and just after it
        after = sum(measure_fair_floor(args.floor_repeats, seed=seed).values())
        print(f"fair floor run {seed} (after verst): total={after * 1e3:.1f}ms", flush=True)
        floors[-1] = (floors[-1] + after) / 2
        times, ev = run_trl(seed, args.steps, eval_rows)
        trl_steps.append(statistics.median(times[args.warmup :]))
        trl_evals.append(ev)
        print(f"trl   run {seed}: median step {trl_steps[-1] * 1e3:.1f} ms, eval {ev:.3f}", flush=True)

    # ratios within each run (same load window), then the median over runs
    trl_over_verst = statistics.median(t / v for t, v in zip(trl_steps, verst_steps, strict=True))
    verst_over_floor = statistics.median(v / f for v, f in zip(verst_steps, floors, strict=True))
    verst_over_plain = statistics.median(v / f for v, f in zip(verst_steps, plains, strict=True))
    print(
        f"steps={args.steps} runs={args.runs} threads={args.threads} batch={PROMPTS}x{GROUP} max_new={MAX_NEW} "
        f"verst_step={statistics.median(verst_steps) * 1e3:.1f}ms trl_step={statistics.median(trl_steps) * 1e3:.1f}ms "
        f"fair_floor={statistics.median(floors) * 1e3:.1f}ms hf_plain={statistics.median(plains) * 1e3:.1f}ms "
        f"warm_start_eval={start_eval:.3f}"
    )
    print(
        f"trl_over_verst_step_time={trl_over_verst:.3f} verst_over_floor={verst_over_floor:.3f} "
        f"verst_eval_reward={statistics.median(verst_evals):.3f} trl_eval_reward={statistics.median(trl_evals):.3f} "
        f"verst_over_hf_plain={verst_over_plain:.3f}"
    )


if __name__ == "__main__":
    main()
