"""The shared-prompt pieces attention (`verst.trainer.train.pieces`) equals SDPA over the dense mask.

Random shared-prompt rows (prompt and response lengths, responses per row, grouped-query head
counts) and random queries, keys and values: `pieces_attention` must give the dense-mask
attention at every real position, and the same gradients for queries, keys and values. A tiny
Llama switched with `use_pieces_attention` must run it for shared-prompt micro-batches only.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

import verst.trainer.train.pieces as pieces_module
from verst.trainer.train.layout import LAYOUTS, DecoderShape, SharedPromptLayout
from verst.trainer.train.logprobs import PolicyLogprobs
from verst.trainer.train.pieces import ATTENTION_NAME, pieces_attention, use_pieces_attention


@st.composite
def rows_of_groups(draw):
    """Sequences of groups sharing a prompt: (tokens, response lengths)."""
    tokens, resp = [], []
    for g in range(draw(st.integers(1, 3))):
        p = draw(st.integers(1, 6))
        for _ in range(draw(st.integers(1, 4))):
            r = draw(st.integers(1, 5))
            tokens.append([g + 1] * p + [7] * r)
            resp.append(r)
    return tokens, resp


@settings(max_examples=25, deadline=None)
@given(
    batch=rows_of_groups(), kv=st.integers(1, 2), rep=st.integers(1, 3), per_row=st.sampled_from([None, 2])
)
def test_pieces_attention_equals_the_dense_mask(batch, kv, rep, per_row):
    tokens, resp = batch
    inputs = SharedPromptLayout(per_row=per_row).build(tokens, resp)
    rows, width = inputs.input_ids.shape
    heads, d = kv * rep, 4
    gen = torch.Generator().manual_seed(len(tokens) * 31 + kv * 7 + rep)
    q, k, v = (
        torch.randn(rows, h, width, d, generator=gen, requires_grad=True) for h in (heads, kv, kv)
    )  # [rows, heads or kv, width, d]
    out = pieces_attention(q, k, v, inputs.pieces, scaling=0.5)  # [rows, width, heads, d]
    dense = F.scaled_dot_product_attention(
        q,
        k.repeat_interleave(rep, 1),
        v.repeat_interleave(rep, 1),
        attn_mask=inputs.attention_mask,
        scale=0.5,
    ).transpose(1, 2)  # [rows, width, heads, d]
    real = torch.zeros(rows * width, dtype=torch.bool)
    real[inputs.pieces.destination] = True
    real = real.view(rows, width)
    torch.testing.assert_close(out[real], dense[real], atol=1e-5, rtol=1e-5)
    weight = torch.randn(out.shape, generator=gen) * real[:, :, None, None]
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    dense_grads = torch.autograd.grad((dense * weight).sum(), (q, k, v))
    for g, ref in zip(grads, dense_grads, strict=True):
        torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-5)


def test_a_switched_model_runs_the_pieces_for_shared_prompts_only(monkeypatch):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=31, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    assert use_pieces_attention(model) and model.config._attn_implementation == ATTENTION_NAME
    calls = []
    real = pieces_module.pieces_attention
    monkeypatch.setattr(pieces_module, "pieces_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    tokens, resp = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [9, 8, 7]], [2, 1, 1]
    wrapped = PolicyLogprobs(model, backend="torch", pieces_min_saved=0)
    shared = wrapped(LAYOUTS["shared_prompt"].build(tokens, resp))[0]
    assert len(calls) == cfg.num_hidden_layers
    padded = wrapped(LAYOUTS["padded"].build(tokens, resp))[0]
    assert len(calls) == cfg.num_hidden_layers  # padded rows: transformers' SDPA, unchanged
    torch.testing.assert_close(shared, padded, atol=1e-5, rtol=1e-5)
    PolicyLogprobs(model, backend="torch")(LAYOUTS["shared_prompt"].build(tokens, resp))
    assert len(calls) == cfg.num_hidden_layers  # rows this small save too little: the dense mask


def test_the_cost_counts_the_pieces_pairs_when_they_save_enough():
    shape = DecoderShape(layer_params=0, attn_width=256)  # attention only
    tokens, resp = [[1] * 100 + [2] * 50] * 8, [50] * 8
    layout = LAYOUTS["shared_prompt"]
    dense = layout.cost(tokens, resp, shape, "sdpa")
    pieces = layout.cost(tokens, resp, shape, ATTENTION_NAME)
    assert dense == pytest.approx(2 * 256 * 500**2)
    assert pieces == pytest.approx(2 * 256 * (100**2 + 8 * 50 * 150))
    built = layout.build(tokens, resp).pieces
    assert pieces == pytest.approx(2 * 256 * built.pairs()) and built.worth_it(256)
    small = [[1] * 10 + [2] * 6] * 8, [6] * 8  # saves < MIN_SAVED_MACS: costed (and run) dense
    assert layout.cost(*small, shape, ATTENTION_NAME) == layout.cost(*small, shape, "sdpa")
    assert not layout.build(*small).pieces.worth_it(256)
