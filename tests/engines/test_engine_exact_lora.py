"""`train.exact_on_policy` with LoRA: the embedded engine's adapter log-probs equal the trainer's
(PEFT's `lora.Linear` on a model with `install_exact`) bit for bit.

Two random non-zero adapters of different ranks and targets plus base-model rows decode in one
continuous batch (multi-LoRA), at engine batch sizes 1, 5 and 64, sampled at temperature 1; the
trainer's exact log-prob path over each adapter's sequences (PEFT with that adapter, the base
rows through `disable_adapter()`) must give every response token's engine value exactly.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from verst.rollout.engine import GenerateRequest, SamplingParams

MODEL = Path(__file__).resolve().parents[2] / "examples" / "reverse_digits" / "model" / "warm_start"
ADAPTERS = {"a": (1, 4, ["q_proj", "v_proj"]), "b": (2, 8, ["o_proj", "up_proj", "down_proj", "gate_proj"])}


def _peft(seed: int, rank: int, targets: list[str]):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    model = get_peft_model(base, config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.mul_(2.0)
    return model


@pytest.fixture(scope="module")
def peft_models():
    return {name: _peft(*spec) for name, spec in ADAPTERS.items()}


async def _engine_run(peft_models, batch: int, exact: bool):
    from peft import get_peft_model_state_dict

    from verst.rollout.engines.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine.from_pretrained(str(MODEL), max_batch_size=batch)
    if exact:
        engine.enable_exact_on_policy()
    for name, model in peft_models.items():
        tensors = get_peft_model_state_dict(model)
        await engine.load_lora_adapter_from_tensors(name, tensors, model.peft_config["default"].to_dict())
    tok = engine.tokenizer
    prompts = [tok(p)["input_ids"] for p in ("123=", "98765=", "4040404=")]
    reqs = [
        GenerateRequest(
            p, SamplingParams(max_new_tokens=4 + i % 7, temperature=1.0, sampling_seed=i), lora_path=name
        )
        for i, (p, name) in enumerate((p, n) for p in prompts for n in ("a", "b", None, "a"))
    ]
    outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
    await engine.close()
    return reqs, outs


def _trainer_logprobs(model, tokens, lengths, base: bool) -> torch.Tensor:
    from verst.trainer.train.logprobs import PolicyLogprobs, pack_sequences

    hf = model.get_base_model()
    with torch.no_grad():
        inputs = pack_sequences(tokens, lengths, layout="padded")
        if base:
            with model.disable_adapter():
                return PolicyLogprobs(hf, backend="exact")(inputs)[0]
        return PolicyLogprobs(hf, backend="exact")(inputs)[0]


def _compare(peft_models, reqs, outs) -> tuple[int, int]:
    """(response tokens checked, tokens whose engine and trainer log-probs differ)."""
    checked = mismatched = 0
    for name in ("a", "b", None):
        picked = [(r, o) for r, o in zip(reqs, outs, strict=True) if r.lora_path == name]
        tokens = [list(r.input_ids) + list(o.output_ids) for r, o in picked]
        lengths = [len(o.output_ids) for _, o in picked]
        model = peft_models[name or "a"]
        trainer = _trainer_logprobs(model, tokens, lengths, base=name is None)
        engine = torch.tensor([x for _, o in picked for x in o.output_logprobs])
        checked += engine.numel()
        mismatched += int((trainer != engine).sum())
    return checked, mismatched


@pytest.fixture(scope="module")
def exact_models(peft_models):
    from verst.rollout.exact_model import install_exact

    for model in peft_models.values():
        install_exact(model.get_base_model())
    return peft_models


@pytest.mark.parametrize(
    "batch", [pytest.param(1, marks=pytest.mark.slow), 5, pytest.param(64, marks=pytest.mark.slow)]
)
def test_lora_rows_equal_the_trainers_bit_for_bit(exact_models, batch):
    torch.set_num_threads(2)
    reqs, outs = asyncio.run(_engine_run(exact_models, batch, exact=True))
    checked, mismatched = _compare(exact_models, reqs, outs)
    assert checked > 50
    assert mismatched == 0, f"{mismatched} of {checked} tokens differ"


def test_lora_rows_differ_without_the_switch(exact_models):
    """The control: the default engine's adapter path rounds differently from the trainer's."""
    torch.set_num_threads(2)
    reqs, outs = asyncio.run(_engine_run(exact_models, 5, exact=False))
    _, mismatched = _compare(exact_models, reqs, outs)
    assert mismatched > 0
