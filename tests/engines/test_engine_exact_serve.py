"""`verst serve --exact-on-policy`: log-probs served over HTTP equal the trainer's bit for bit.

A real `verst serve` app on 127.0.0.1 (the engine switched as the flag does), a batch of sampled
requests through the SGLang client, and the trainer's exact log-prob path (`PolicyLogprobs`
with the "exact" backend on a model with `install_exact`) over the same tokens: every token
equal. The same requests against a server without the switch differ.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from serve_testlib import serve_app

from verst.rollout.engine import GenerateRequest, SamplingParams

MODEL = Path(__file__).resolve().parents[2] / "examples" / "reverse_digits" / "model" / "warm_start"


async def _served(exact: bool) -> tuple[list[list[int]], list[list[float]]]:
    from verst.rollout.engines.embedded.engine import EmbeddedEngine
    from verst.rollout.engines.serve.server import build_app
    from verst.rollout.engines.sglang.client import SGLangClient

    engine = EmbeddedEngine.from_pretrained(str(MODEL), max_batch_size=7)
    if exact:
        engine.enable_exact_on_policy()
    tok = engine.tokenizer
    prompts = [tok(p)["input_ids"] for p in ("123=", "98765=", "4040404=")]
    async with serve_app(build_app(engine)) as url:
        client = SGLangClient(url)
        reqs = [
            GenerateRequest(ids, SamplingParams(max_new_tokens=10, temperature=1.0))
            for ids in (p for p in prompts for _ in range(4))
        ]
        outs = await asyncio.gather(*(client.generate(r) for r in reqs))
        await client.close()
    await engine.close()
    tokens = [list(r.input_ids) + list(o.output_ids) for r, o in zip(reqs, outs, strict=True)]
    return tokens, [list(o.output_logprobs) for o in outs]


def _trainer(tokens: list[list[int]], lengths: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from verst.rollout.exact_model import install_exact
    from verst.trainer.train.logprobs import PolicyLogprobs, pack_sequences

    model = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
    install_exact(model)
    with torch.no_grad():
        lp, _ = PolicyLogprobs(model, backend="exact")(pack_sequences(tokens, lengths, packing=False))
    return lp


def test_served_logprobs_equal_the_trainers_bit_for_bit():
    tokens, served = asyncio.run(_served(exact=True))
    lengths = [len(s) for s in served]
    assert sum(lengths) > 0
    trainer = _trainer(tokens, lengths)
    assert torch.equal(trainer, torch.tensor([x for s in served for x in s]))


def test_without_the_switch_they_differ():
    tokens, served = asyncio.run(_served(exact=False))
    trainer = _trainer(tokens, [len(s) for s in served])
    assert not torch.equal(trainer, torch.tensor([x for s in served for x in s]))
