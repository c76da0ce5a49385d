"""Engine/trainer mismatch and what each rollout correction does with it: bf16 engine vs fp32 engine.

Why: the rollout corrections (`[algorithm.rollout_correction]`, docs/algorithms.md) re-weight or
drop tokens by the ratio of the trainer's and the engine's probability of each sampled token.
How much they drop depends on how far the two disagree. This samples reverse_digits prompts from
the example's warm start with the embedded engine in bfloat16 and, as the baseline in the same
run, in float32, scores every sampled token with the fp32 trainer (`PolicyLogprobs`, the train
side's log-prob path), and reports for each correction with its default options the fraction of
tokens and of sequences it drops, its mean weight, the ratio quantiles and two estimates of
KL(engine ‖ trainer) — the same `correction_metrics` a training run logs.

With the default bands the tiny model's bf16 mismatch drops nothing, so tighter bands
[1/c, c] of the two MIS variants are swept too.

Run:  uv run python benchmarks/rollout_mismatch.py [--prompts 16 --samples 8 --threads 2]
Last line: bf16_kl_k3=... fp32_kl_k3=... kl_bf16_vs_fp32=<ratio> bf16_<type>_masked_frac=...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import torch

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.config import EmbeddedEngineConfig
from verst.trainer.algorithms import ROLLOUT_CORRECTION_CONFIGS
from verst.trainer.algorithms.rollout_correction import correction_metrics
from verst.trainer.train.logprobs import PolicyLogprobs, pack_sequences, unflatten

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "reverse_digits"
TYPES = ("tis", "seq_tis", "mis_token", "mis_seq", "icepop")
BANDS = {  # tighter bands [1/c, c] than the defaults, where precision mismatch starts to drop tokens
    "mis_token": (1.05, 1.01, 1.002),
    "mis_seq": (1.01, 1.002, 1.0005),  # geometric mean of the token ratios
}


def prompts(n: int) -> list[str]:
    rows = [json.loads(line) for line in (EXAMPLE / "data" / "eval.jsonl").read_text().splitlines()]
    return [r["prompt"] for r in rows[:n]]


async def sample(dtype: str, texts: list[str], samples: int, max_new: int) -> tuple[list, list, list]:
    """Prompt+response ids, response lengths and the engine's log-probs of each sample."""
    cfg = EmbeddedEngineConfig(model_path=str(EXAMPLE / "model" / "warm_start"), device="cpu", dtype=dtype)
    engine = await cfg.build(max_concurrency=len(texts) * samples)
    tok = engine.tokenizer  # type: ignore[attr-defined]
    torch.manual_seed(0)
    reqs = []
    for text in texts:
        ids = tok(text)["input_ids"]
        for _ in range(samples):
            reqs.append((ids, GenerateRequest(ids, SamplingParams(max_new_tokens=max_new, temperature=1.0))))
    outs = await asyncio.gather(*(engine.generate(r) for _, r in reqs))
    await engine.close()
    tokens = [list(ids) + list(o.output_ids) for (ids, _), o in zip(reqs, outs, strict=True)]
    return tokens, [len(o.output_ids) for o in outs], [list(o.output_logprobs) for o in outs]


@torch.no_grad()
def trainer_logprobs(tokens: list, lengths: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(EXAMPLE / "model" / "warm_start"), dtype=torch.float32)
    module = PolicyLogprobs(model.eval())
    lp, _ = module(pack_sequences(tokens, lengths, packing=False))
    return unflatten(lp, lengths, max(lengths))


def measure(dtype: str, texts: list[str], samples: int, max_new: int) -> dict[str, float]:
    tokens, lengths, engine_lp = asyncio.run(sample(dtype, texts, samples, max_new))
    width = max(lengths)
    rollout = torch.zeros(len(tokens), width)
    mask = torch.zeros(len(tokens), width)
    for i, lps in enumerate(engine_lp):
        rollout[i, : len(lps)] = torch.tensor(lps)
        mask[i, : len(lps)] = 1.0
    old = trainer_logprobs(tokens, lengths)
    log_ratio = (old - rollout).double()
    mask = mask.double()
    out: dict[str, float] = {}
    base = correction_metrics(log_ratio, mask, mask)
    for k in ("rc_kl_k1", "rc_kl_k3", "rc_ratio_q05", "rc_ratio_q50", "rc_ratio_q95", "rc_ratio_max"):
        out[k.removeprefix("rc_")] = float(base[k])
    for name in TYPES:
        correction = ROLLOUT_CORRECTION_CONFIGS.parse(name).build()
        m = correction_metrics(log_ratio, mask, correction(log_ratio, mask))
        out[f"{name}_masked_frac"] = float(m["rc_masked_frac"])
        out[f"{name}_masked_seq_frac"] = float(m["rc_masked_seq_frac"])
        out[f"{name}_weight_mean"] = float(m["rc_weight_mean"])
    for name, caps in BANDS.items():
        for c in caps:
            correction = ROLLOUT_CORRECTION_CONFIGS.parse({"type": name, "lo": 1 / c, "hi": c}).build()
            m = correction_metrics(log_ratio, mask, correction(log_ratio, mask))
            out[f"{name}[1/{c},{c}]_masked_frac"] = float(m["rc_masked_frac"])
    out["tokens"] = float(mask.sum())
    out["mean_abs_log_ratio"] = float((log_ratio.abs() * mask).sum() / mask.sum())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    texts = prompts(args.prompts)
    t0 = time.perf_counter()
    res = {d: measure(d, texts, args.samples, args.max_new_tokens) for d in ("float32", "bfloat16")}
    print(f"{len(texts)} prompts x {args.samples} samples, trainer float32, {time.perf_counter() - t0:.1f} s")
    print(f"{'':36s} {'engine fp32':>12s} {'engine bf16':>12s}")
    for key in res["float32"]:
        print(f"{key:36s} {res['float32'][key]:12.4g} {res['bfloat16'][key]:12.4g}")
    bf, fp = res["bfloat16"], res["float32"]
    parts = [f"bf16_kl_k3={bf['kl_k3']:.3g}", f"fp32_kl_k3={fp['kl_k3']:.3g}"]
    parts.append(f"kl_bf16_vs_fp32={bf['kl_k3'] / max(fp['kl_k3'], 1e-30):.3g}")
    parts += [f"bf16_{t}_masked_frac={bf[f'{t}_masked_frac']:.4f}" for t in TYPES]
    print(" ".join(parts))


if __name__ == "__main__":
    main()
