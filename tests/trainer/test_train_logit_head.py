"""Trainer log-probs apply each family's logit post-processing, as the engine does.

`*ForCausalLM.forward` post-processes the LM head's output in several families (Granite
`logits_scaling`, Gemma-2/3 `final_logit_softcapping`, Cohere `logit_scale`, ...); the trainer
runs only the decoder and the head, so it must apply the same. Tiny random models of each family
(built from config, nothing downloaded) generate through the real embedded engine; the trainer's
log-probs of the same tokens — direct and chunked paths — agree with the engine's within 1e-4.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
import transformers

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.trainer.train.logit_head import LogitHead, check_logit_head, logit_head
from verst.trainer.train.logprobs import PolicyLogprobs, pack_sequences

V = 48
SMALL = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
SMALL |= {"num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 64}
SMALL |= {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
FULL = {"layer_types": ["full_attention"] * 2}  # the embedded engine serves full-attention caches
GEMMA = {"head_dim": 16, "query_pre_attn_scalar": 16, **FULL}

FAMILIES = {
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 4.0}),
    "granitemoe": (
        "GraniteMoeConfig", "GraniteMoeForCausalLM", {"logits_scaling": 3.0, "num_local_experts": 2,
                                                      "num_experts_per_tok": 1},
    ),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {**GEMMA, "final_logit_softcapping": 0.5}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**GEMMA, "final_logit_softcapping": 0.5}),
    "vaultgemma": ("VaultGemmaConfig", "VaultGemmaForCausalLM", {**GEMMA, "final_logit_softcapping": 0.5}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.25}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {"logit_scale": 3.0, **FULL}),
    "phi (lm_head bias)": ("PhiConfig", "PhiForCausalLM", {}),
}  # fmt: skip


def _tiny(family: str) -> torch.nn.Module:
    cfg_name, cls_name, extra = FAMILIES[family]
    cfg = getattr(transformers, cfg_name)(**SMALL, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(cfg).float().eval()
    head = model.get_output_embeddings()
    with torch.no_grad():  # random init leaves logits near 0, where post-processing barely shows
        head.weight.mul_(20.0)
        if head.bias is not None:
            head.bias.normal_(0.0, 2.0)
    return model


async def _generate(engine: EmbeddedEngine, prompts: list[list[int]], temperature: float):
    sampling = SamplingParams(max_new_tokens=6, temperature=temperature, ignore_eos=True)
    outs = await asyncio.gather(*(engine.generate(GenerateRequest(p, sampling)) for p in prompts))
    await engine.close()
    return outs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trainer_logprobs_match_embedded_engine_for_logit_post_processing_families(family):
    model = _tiny(family)
    head = check_logit_head(model)  # the model's own forward agrees with the described head
    temperature = 0.7
    prompts = [[1, 5 + i, 9, 11 + 2 * i] for i in range(3)]
    engine = EmbeddedEngine(copy.deepcopy(model), max_batch_size=8, batch_wait_s=0.0)
    outs = asyncio.run(_generate(engine, prompts, temperature))
    engine_lp = torch.tensor([lp for o in outs for lp in o.output_logprobs])
    tokens = [p + o.output_ids for p, o in zip(prompts, outs, strict=True)]
    inputs = pack_sequences(tokens, [len(o.output_ids) for o in outs], packing=False)
    for backend, chunk in (("auto", 256), ("torch", 2), ("naive", 256)):  # direct, chunked, naive
        policy = PolicyLogprobs(model, backend=backend, chunk_size=chunk)
        with torch.no_grad():
            lp, _ = policy(inputs, temperature=temperature)
        err = float((lp - engine_lp).abs().max())
        assert err < 1e-4, f"{family} {backend}: trainer vs engine max |diff| {err:.3g} (head {head})"


def test_logit_head_describes_each_family():
    assert logit_head(_tiny("granite")).scale == pytest.approx(0.25)
    assert logit_head(_tiny("cohere")).scale == pytest.approx(0.25)
    assert logit_head(_tiny("gemma2")).softcap == pytest.approx(0.5)
    assert logit_head(_tiny("phi (lm_head bias)")).bias is not None


def test_a_model_whose_head_verst_does_not_know_is_refused():
    model = _tiny("granite")
    model.config.logits_scaling = 4.0
    model.__class__ = type("MysteryForCausalLM", (type(model),), {})  # a Granite verst has no entry for
    with pytest.raises(ValueError, match="MysteryForCausalLM: log-probs from the LM head"):
        check_logit_head(model)


def test_scale_and_softcap_fold_into_kernel_arguments():
    """cap * tanh(s x / cap) / T, computed by the kernel from (T/s, cap/s), on the chunked path."""
    from verst.kernels import linear_token_logprobs

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(5, 8, generator=g), torch.randn(30, 8, generator=g) * 3
    head = LogitHead(weight=weight, bias=torch.randn(30, generator=g), scale=0.3, softcap=2.0)
    targets = torch.randint(0, 30, (5,), generator=g)
    want = torch.log_softmax(head.logits(hidden) / 0.9, -1).gather(-1, targets[:, None])[:, 0]
    got = linear_token_logprobs(hidden, target_ids=targets, chunk_size=2, **head.kernel_args(0.9))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
