"""The embedded engine's grouped-query attention (`engines/embedded/attention.py`) is transformers' SDPA
attention, row for row, without repeating the KV heads: real tiny GQA Llamas, padded prefill,
decode steps on the cache, the unpadded (maskless) prefill, and the engine end to end."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded.attention import ATTENTION_NAME, use_grouped_sdpa
from verst.rollout.engines.embedded.engine import EmbeddedEngine


def _llama(heads: int, kv: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=50, hidden_size=8 * heads, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv, intermediate_size=32, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def _decode_logits(model, ids, attention, steps: int) -> torch.Tensor:
    """Prefill (left-padded) + `steps` greedy decode steps on the cache → [steps + 1, b, vocab]."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    pos = (attention.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(
            input_ids=ids, attention_mask=attention, position_ids=pos, past_key_values=cache, use_cache=True
        )
        logits, mask, p = [out.logits[:, -1]], attention, pos[:, -1:]
        for _ in range(steps):
            tok = logits[-1].argmax(-1)
            mask = torch.cat([mask, mask.new_ones((len(tok), 1))], dim=1)
            p = p + 1
            out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=p, past_key_values=cache)
            logits.append(out.logits[:, -1])
    return torch.stack(logits)


@settings(max_examples=15, deadline=None)
@given(
    groups=st.sampled_from([(4, 2), (6, 2), (6, 3), (4, 1)]),
    pads=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    width=st.integers(7, 12),
    seed=st.integers(0, 1000),
)
def test_grouped_attention_equals_sdpa(groups, pads, width, seed):
    heads, kv = groups
    model = _llama(heads, kv)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (len(pads), width), generator=g)
    attention = torch.ones_like(ids)
    for i, p in enumerate(pads):
        attention[i, :p] = 0  # left padding (all-zero pads: no mask, the causal path)
    want = _decode_logits(model, ids, attention, steps=4)
    assert use_grouped_sdpa(model)
    assert model.config._attn_implementation == ATTENTION_NAME
    got = _decode_logits(model, ids, attention, steps=4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_models_without_grouped_heads_are_left_alone():
    model = _llama(4, 4)
    assert not use_grouped_sdpa(model)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.timeout(120)
def test_engine_switches_and_generates_what_sdpa_generates(tmp_path):
    model = _llama(6, 2, seed=3)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(50)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")))
    tok.pad_token, tok.eos_token = "t0", "t1"
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")

    async def generate(engine):
        params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
        prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [5, 6, 7], [20]]
        outs = await asyncio.gather(
            *(engine.generate(GenerateRequest(p, params, return_logprob=True)) for p in prompts)
        )
        await engine.close()
        return outs

    grouped = EmbeddedEngine.from_pretrained(tmp_path / "m")
    assert grouped.model.config._attn_implementation == ATTENTION_NAME
    stock = EmbeddedEngine(_llama(6, 2, seed=3), tok)
    assert stock.model.config._attn_implementation == "sdpa"
    a, b = asyncio.run(generate(grouped)), asyncio.run(generate(stock))
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids
        assert x.output_logprobs == pytest.approx(y.output_logprobs, abs=1e-5)
