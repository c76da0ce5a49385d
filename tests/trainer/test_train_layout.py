"""Micro-batch layouts (`verst.trainer.layout`): the shared-prompt layout equals the padded one.

A real tiny Hugging Face Llama (random weights, built from a config) runs the same sequences in
the padded, packed and shared-prompt layouts; log-probs, entropy and the gradients of a loss
over them w.r.t. every parameter must agree within float32 tolerance — for mixed micro-batches
(groups sharing a prompt, singletons, interleaved order, different prompt and response lengths,
agentic responses whose tool tokens are loss-masked), SDPA and eager attention.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from verst.trainer.layout import (
    LAYOUTS,
    DecoderShape,
    LayoutChooser,
    PackedInputs,
    prompt_groups,
    shared_prompt_unsupported,
)
from verst.trainer.logprobs import PolicyLogprobs, pack_sequences

VOCAB = 61


def tiny_llama(attn: str, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation=attn,
        **overrides,
    )
    return LlamaForCausalLM(cfg).float()


MODELS = {attn: PolicyLogprobs(tiny_llama(attn), backend="torch", chunk_size=7) for attn in ("sdpa", "eager")}


def run(model: PolicyLogprobs, inputs: PackedInputs, weights: torch.Tensor):
    """Log-probs, entropy and parameter gradients of `Σ w·lp + 0.1 Σ w·ent` (w: a loss mask)."""
    model.zero_grad(set_to_none=True)
    lp, ent = model(inputs, temperature=0.8, return_entropy=True)
    ((lp * weights).sum() + 0.1 * (ent * weights).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), ent.detach(), grads


@st.composite
def micro_batch(draw):
    """Groups of samples sharing a prompt (and singletons), shuffled; per-token loss weights."""
    tokens, resp, weights = [], [], []
    for _ in range(draw(st.integers(1, 4))):
        prompt = draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=7))
        for _ in range(draw(st.integers(1, 3))):
            r = draw(st.integers(1, 6))
            response = draw(st.lists(st.integers(1, VOCAB - 1), min_size=r, max_size=r))
            agentic = draw(st.booleans())  # a tool result in the middle of the response: masked
            mask = [0.0 if agentic and 1 <= j < r - 1 else 1.0 for j in range(r)]
            tokens.append(prompt + response)
            resp.append(r)
            weights.append(mask)
    order = draw(st.permutations(range(len(tokens))))
    return [tokens[i] for i in order], [resp[i] for i in order], [w for i in order for w in weights[i]]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@settings(max_examples=15, deadline=None)
@given(batch=micro_batch())
def test_shared_prompt_and_packed_equal_padded(attn, batch):
    tokens, resp, w = batch
    model, weights = MODELS[attn], torch.tensor(w)
    ref_lp, ref_ent, ref_grads = run(model, pack_sequences(tokens, resp, layout="padded"), weights)
    for layout in ("shared_prompt", "packed"):
        inputs = pack_sequences(tokens, resp, layout=layout)
        assert inputs.target_ids.tolist() == [
            t for seq, r in zip(tokens, resp, strict=True) for t in seq[len(seq) - r :]
        ]
        lp, ent, grads = run(model, inputs, weights)
        torch.testing.assert_close(lp, ref_lp, atol=2e-5, rtol=1e-5, msg=lambda m, la=layout: f"{la} lp: {m}")
        torch.testing.assert_close(ent, ref_ent, atol=2e-5, rtol=1e-5, msg=lambda m, la=layout: f"{la}: {m}")
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(
                g, ref_grads[name], atol=2e-5, rtol=1e-4, msg=lambda m, n=name, la=layout: f"{la} {n}: {m}"
            )


def test_shared_prompt_row_layout():
    # seq 0 and 2 share prompt [5, 6]; seq 1 is alone (prompt [5]); order is kept in the targets
    tokens = [[5, 6, 7, 8], [5, 9, 9], [5, 6, 3]]
    out = pack_sequences(tokens, [2, 2, 1], layout="shared_prompt")
    assert prompt_groups(tokens, [2, 2, 1]) == [[0, 2], [1]]
    assert out.input_ids.tolist() == [[5, 6, 7, 8, 3], [5, 9, 9, 0, 0]]
    assert out.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 2, 0, 0]]
    # seq0: predicted by pos 1 (last prompt) and 2; seq1: row 1 pos 0, 1; seq2: pos 1 again (shared)
    assert out.gather_index.tolist() == [1, 2, 5, 6, 1]
    assert out.target_ids.tolist() == [7, 8, 9, 9, 3]
    m = out.attention_mask[0, 0].int().tolist()
    assert m == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 1],  # resp 2 sees the prompt and itself, not resp 1
    ]
    pad = out.attention_mask[1, 0].int().tolist()
    assert pad[3] == [0, 0, 0, 1, 0] and pad[4] == [0, 0, 0, 0, 1]  # padding attends only itself


def shape() -> DecoderShape:
    return DecoderShape.from_config(tiny_llama("sdpa").config)


def test_auto_picks_shared_prompt_for_groups_and_padded_for_distinct_prompts():
    chooser = LayoutChooser.build("auto", config=tiny_llama("sdpa").config, attn="sdpa")
    assert chooser.candidates == ("padded", "packed", "shared_prompt")
    prompt = list(range(1, 41))
    group = [prompt + [7] * 12 for _ in range(8)]
    assert chooser.choose(group, [12] * 8) == "shared_prompt"
    distinct = [[i + 1] * 40 + [7] * 12 for i in range(8)]
    assert chooser.choose(distinct, [12] * 8) == "padded"
    # one long and many short sequences, nothing shared: padding wastes most, packing wins
    ragged = [[1] * 60] + [[i + 2, 3] for i in range(30)]
    assert chooser.choose(ragged, [1] * 31) == "packed"
    for name, layout in LAYOUTS.items():  # the cost is what decides
        assert layout.cost(group, [12] * 8, shape(), "sdpa") > 0, name


def test_flash_attention_never_gets_shared_prompt_and_packs_varlen():
    cfg = tiny_llama("sdpa").config
    chooser = LayoutChooser.build("auto", config=cfg, attn="flash_attention_2")
    assert chooser.candidates == ("padded", "packed")
    ragged = [[1] * 30, [2] * 5, [3] * 9]
    assert chooser.choose(ragged, [2, 2, 2]) == "packed"  # varlen: no padding, linear attention
    with pytest.raises(ValueError, match="flash_attention_2 takes no custom attention mask"):
        LayoutChooser.build("shared_prompt", config=cfg, attn="flash_attention_2")


def test_fixed_layouts_and_bad_names():
    cfg = tiny_llama("sdpa").config
    assert LayoutChooser.build("padded", config=cfg, attn="sdpa").candidates == ("padded",)
    with pytest.raises(ValueError, match=r"unknown layout 'stacked'.*padded, packed, shared_prompt"):
        LayoutChooser.build("stacked", config=cfg, attn="sdpa")
    with pytest.raises(ValueError, match="unknown layout"):
        pack_sequences([[1, 2]], [1], layout="stacked")


def test_shared_prompt_refused_for_sliding_windows_and_models_that_mix_tokens():
    sliding = tiny_llama("sdpa").config
    sliding.sliding_window = 16
    assert "sliding-window" in shared_prompt_unsupported(sliding)
    auto = LayoutChooser.build("auto", config=sliding, attn="sdpa")
    assert "shared_prompt" not in auto.candidates
    with pytest.raises(ValueError, match=r"sliding-window.*set train.layout"):
        LayoutChooser.build("shared_prompt", config=sliding, attn="sdpa")
    model = MODELS["sdpa"]

    def probe(inputs):
        with torch.no_grad():
            return model(inputs)[0]

    assert shared_prompt_unsupported(model.policy.config, probe) is None

    def leaky(inputs):  # a model that ignores the 4D mask: plain causal over the row, responses mix
        return probe(dataclasses.replace(inputs, attention_mask=None))

    assert "differ between the padded and the shared-prompt layout" in shared_prompt_unsupported(
        model.policy.config, leaky
    )
