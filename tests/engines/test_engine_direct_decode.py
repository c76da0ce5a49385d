"""The embedded engine's direct decode step (`engines/embedded/direct.py`) is the model's own
forward without its wrappers: for every family it serves (dense Llama-likes, GQA on the grouped
SDPA, the MoE families) a left-padded prefill then decode steps on the engine's growing cache
give the logits `model(...)` gives; families and attention it does not serve fall back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.rollout.engines.embedded.attention import ScoresAttention, use_grouped_sdpa
from verst.rollout.engines.embedded.batch import DecodeBatch
from verst.rollout.engines.embedded.direct import FAMILIES, DirectDecode, ModuleRope, RopeTable
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


@settings(max_examples=25, deadline=None)
@given(
    groups=st.sampled_from([(4, 4), (4, 2), (6, 3), (4, 1)]),
    batch=st.integers(1, 5),
    width=st.integers(1, 40),
    seed=st.integers(0, 10_000),
)
def test_scores_attention_equals_sdpa(groups, batch, width, seed):
    """`ScoresAttention` (one query per row, grouped heads folded) is SDPA's attention over the
    repeated KV heads, to float rounding, with left padding of any width (the fed column unmasked)."""
    heads, kv = groups
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, 8, generator=g)  # [b, heads, 1, d]
    k, v = torch.randn(2, batch, kv, width, 8, generator=g)  # [b, kv, L, d] each
    attend = torch.rand(batch, 1, 1, width, generator=g) < 0.6
    attend[..., -1] = True  # a row always sees its own token
    bias = torch.zeros(attend.shape).masked_fill_(~attend, float("-inf"))
    rep = heads // kv
    want = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=attend, scale=0.3
    )  # [b, heads, 1, d]
    got = ScoresAttention()(q, k, v, bias, 0.3)  # [b, 1, heads, d]
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    groups=st.sampled_from([(4, 4), (6, 2), (9, 3)]),
    batch=st.integers(1, 4),
    t=st.integers(2, 6),
    width=st.integers(0, 30),
    seed=st.integers(0, 10_000),
)
def test_scores_attention_with_several_queries_equals_sdpa(groups, batch, t, width, seed):
    """`ScoresAttention` with `t` queries per row (a speculative verify forward's `k + 1`: left
    padding, then the causal mask inside the `t` new columns) is SDPA's attention over the
    repeated KV heads, to float rounding, query position by query position."""
    heads, kv = groups
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, t, 8, generator=g)  # [b, heads, t, d]
    k, v = torch.randn(2, batch, kv, width + t, 8, generator=g)  # [b, kv, L, d] each
    attend = (torch.rand(batch, 1, 1, width + t, generator=g) < 0.6).expand(batch, 1, t, width + t).clone()
    attend[..., width:] = torch.ones(t, t, dtype=torch.bool).tril()  # new tokens: causal
    bias = torch.zeros(attend.shape).masked_fill_(~attend, float("-inf"))
    rep = heads // kv
    want = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=attend, scale=0.3
    )  # [b, heads, t, d]
    got = ScoresAttention()(q, k, v, bias, 0.3)  # [b, t, heads, d]
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_cols", [0, 4, ScoresAttention.MAX_COLS])
def test_direct_decode_on_sdpa_and_scores_attention(monkeypatch, max_cols):
    """Steps past `ScoresAttention.MAX_COLS` columns run SDPA on the additive mask; the logits
    equal the model's forward either way (0: SDPA throughout, 4: both within one decode)."""
    monkeypatch.setattr(ScoresAttention, "MAX_COLS", max_cols)
    for model in (_dense("llama"), _dense("llama", heads=4, kv=2)):
        ids = torch.randint(3, VOCAB, (3, 3), generator=torch.Generator().manual_seed(max_cols))
        attention = torch.ones_like(ids)
        attention[0, :2] = 0
        want = _decode(model, ids, attention, 4, None)
        torch.testing.assert_close(_decode(model, ids, attention, 4, DirectDecode.of(model)), want)


def test_rope_table_is_the_rotary_modules_values():
    """The table's rows are bit for bit what the rotary module computes for those positions
    (with RoPE's signed sin), after growing past its first size and for any batch of positions."""
    model = _dense("qwen3")
    rotary = model.model.rotary_emb
    table = RopeTable.of(rotary)
    assert isinstance(table, RopeTable)
    hidden = torch.zeros(5, 1, 32)
    for cols in (7, RopeTable.MIN_ROWS + 3):
        pos = torch.randint(0, cols, (5, 1), generator=torch.Generator().manual_seed(cols))
        cos, signed = table(hidden, pos, cols)  # [5, 1, 1, d] each
        want_cos, want_sin = rotary(hidden, position_ids=pos)  # [5, 1, d] each
        half = want_sin.shape[-1] // 2
        assert torch.equal(cos, want_cos[:, None])
        assert torch.equal(signed, torch.cat([-want_sin[..., :half], want_sin[..., half:]], -1)[:, None])
    assert table.table is not None and table.table.shape[0] >= RopeTable.MIN_ROWS + 3


def test_dynamic_rope_runs_the_module_every_step():
    """RoPE types whose frequencies change with the length are never tabled."""
    model = _dense("llama")
    model.model.rotary_emb.rope_type = "dynamic"
    assert isinstance(RopeTable.of(model.model.rotary_emb), ModuleRope)
    assert isinstance(DirectDecode.of(model).rope, ModuleRope)
