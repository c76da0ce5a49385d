"""The embedded engine's direct decode step (`engines/embedded/direct.py`) is the model's own
forward without its wrappers: for every family it serves (dense Llama-likes, GQA on the grouped
SDPA, the MoE families) a left-padded prefill then decode steps on the engine's growing cache
give the logits `model(...)` gives; families and attention it does not serve fall back."""

from __future__ import annotations

import pytest
import torch

from verst.rollout.engines.embedded.attention import use_grouped_sdpa
from verst.rollout.engines.embedded.batch import DecodeBatch
from verst.rollout.engines.embedded.direct import FAMILIES, DirectDecode
from verst.rollout.engines.embedded.kv_cache import growing_cache
from verst.rollout.toy import decoder_fields
from verst.rollout.toy_moe import build_tiny_moe

VOCAB = 40


def _dense(family: str, heads: int = 4, kv: int = 4):
    import transformers

    fields = {
        **decoder_fields(VOCAB, hidden_size=32, num_layers=2, num_heads=heads),
        "num_key_value_heads": kv,
    }
    config = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[family](**fields, intermediate_size=48, head_dim=32 // heads, sliding_window=None)
    torch.manual_seed(1)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _model(family: str):
    if family in ("qwen3_moe", "mixtral"):
        return build_tiny_moe(family, VOCAB, hidden_size=32, num_layers=2, num_heads=4, seed=1).eval()
    return _dense(family)


def _decode(model, ids, attention, steps: int, direct: DirectDecode | None) -> torch.Tensor:
    """Prefill (left-padded, through `model`) + greedy decode steps, each through `direct` or
    `model(...)` → logits [steps + 1, batch, vocab]."""
    cache = growing_cache(model.config)
    pos = (attention.cumsum(1) - 1).clamp(min=0)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=attention, position_ids=pos, past_key_values=cache)
        logits, mask, p = [out.logits[:, -1]], attention, pos[:, -1:]
        for _ in range(steps):
            tok = logits[-1].argmax(-1)[:, None]  # [batch, 1]
            mask = torch.cat([mask, mask.new_ones((len(tok), 1))], dim=1)
            p = p + 1
            if direct is None:
                step = model(input_ids=tok, attention_mask=mask, position_ids=p, past_key_values=cache)
                logits.append(step.logits[:, -1])
            else:
                logits.append(direct(tok, mask, p, cache))
    return torch.stack(logits)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_direct_decode_equals_the_models_forward(family):
    model = _model(family)
    ids = torch.randint(3, VOCAB, (3, 8), generator=torch.Generator().manual_seed(len(family)))
    attention = torch.ones_like(ids)
    attention[1, :3] = attention[2, :5] = 0  # left padding of different widths
    direct = DirectDecode.of(model)
    assert direct is not None
    want = _decode(model, ids, attention, 3, None)
    torch.testing.assert_close(_decode(model, ids, attention, 3, direct), want, rtol=1e-5, atol=1e-5)


def test_direct_decode_with_grouped_heads():
    model = _dense("llama", heads=4, kv=2)
    assert use_grouped_sdpa(model)
    ids = torch.randint(3, VOCAB, (3, 7), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(ids)
    attention[0, :3] = 0
    want = _decode(model, ids, attention, 3, None)
    torch.testing.assert_close(_decode(model, ids, attention, 3, DirectDecode.of(model)), want)


def test_unserved_models_decode_through_the_model():
    eager = _dense("llama")
    eager.set_attn_implementation("eager")
    assert DirectDecode.of(eager) is None
    assert DecodeBatch(eager, 0, None).direct is None
    assert DecodeBatch(_dense("qwen2"), 0, None).direct is not None
