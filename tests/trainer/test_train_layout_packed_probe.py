"""`train.layout = "auto"` never picks `packed` for a model whose attention ignores packed position
ids (#25 item 2). Tiny random OPT and Falcon models built from their configs (transformers'
OPTConfig / FalconConfig; nothing downloads) mix the sequences of a packed row under SDPA, so
their packed log-probs differ from scoring each sequence alone; the probe finds it and drops
`packed` (asking for it is a ConfigError), while a Llama keeps it."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    FalconConfig,
    FalconForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
)

from verst.rollout.errors import ConfigError
from verst.trainer.train.layout import LAYOUTS
from verst.trainer.train.layout_choice import LayoutChooser, packed_unsupported
from verst.trainer.train.logprobs import PolicyLogprobs

VOCAB = 61


def _build(name: str) -> PolicyLogprobs:
    torch.manual_seed(0)
    common = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    if name == "opt":
        cfg = OPTConfig(**common, ffn_dim=64, max_position_embeddings=128, word_embed_proj_dim=32)
        model = OPTForCausalLM(cfg)
    elif name == "falcon":
        model = FalconForCausalLM(FalconConfig(**common))
    else:
        cfg = LlamaConfig(**common, intermediate_size=64, num_key_value_heads=2, max_position_embeddings=128)
        model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    return PolicyLogprobs(model.float().eval(), backend="torch", chunk_size=7)


MODELS = {name: _build(name) for name in ("opt", "falcon", "llama")}


def _probe(model):
    def probe(inputs):
        with torch.no_grad():
            return model(inputs)[0]

    return probe


def _chooser(name: str, requested: str = "auto") -> LayoutChooser:
    model = MODELS[name]
    return LayoutChooser.build(requested, config=model.policy.config, attn="sdpa", probe=_probe(model))


@pytest.mark.parametrize("name", ["opt", "falcon"])
def test_auto_never_packs_a_model_whose_attention_ignores_packed_positions(name):
    model = MODELS[name]
    # the defect is real: distinct prompts of uneven lengths, packed vs each sequence alone
    tokens = [[3, 8, 13, 18, 23, 28, 33, 38], [5, 10, 15], [7, 14, 21, 28, 35, 42]]
    resp = [3, 1, 4]
    padded = _probe(model)(LAYOUTS["padded"].build(tokens, resp))
    packed = _probe(model)(LAYOUTS["packed"].build(tokens, resp))
    assert float((padded - packed).abs().max()) > 1e-2
    assert "differ between the padded and the packed layout" in packed_unsupported(_probe(model), vocab=VOCAB)
    chooser = _chooser(name)
    assert "packed" not in chooser.candidates and "padded" in chooser.candidates
    ragged = [[1] * 60] + [[i + 2, 3] for i in range(30)]  # where packing would win on cost
    assert chooser.choose(ragged, [1] * 31) != "packed"
    with pytest.raises(ConfigError, match=r"train.layout: 'packed' would not give this model's log-probs"):
        _chooser(name, "packed")


def test_a_model_that_separates_packed_sequences_keeps_packed():
    assert packed_unsupported(_probe(MODELS["llama"]), vocab=VOCAB) is None
    assert _chooser("llama").candidates == ("padded", "packed", "shared_prompt")
    assert _chooser("llama", "packed").candidates == ("packed",)
