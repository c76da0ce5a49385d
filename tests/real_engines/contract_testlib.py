"""What the engine contract suite needs besides the engines: the trainer's log-probs, changed
checkpoints to refit to, a PEFT adapter, and one handle per engine under test."""

from __future__ import annotations

import shutil
from contextlib import asynccontextmanager
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def load_policy(model_dir: str | Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def trainer_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    """The trainer's per-token log-probs of `output` after `prompt` (`verst.trainer.train.logprobs`)."""
    from verst.trainer.train.logprobs import PolicyLogprobs, pack_sequences

    inputs = pack_sequences([prompt + output], [len(output)], layout="padded")
    with torch.no_grad():
        lp, _ = PolicyLogprobs(model)(inputs, temperature=temperature)
    return lp.float()


def greedy_ids(model, prompt: list[int], n: int, eos: int | None) -> list[int]:
    """Greedy decoding by argmax of the trainer's model (the ids every engine must return)."""
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(nxt)
            ids.append(nxt)
            if nxt == eos:
                break
    return out


def perturbed_checkpoint(src: str | Path, dst: str | Path, seed: int, scale: float = 0.3) -> Path:
    """A copy of the checkpoint at `src` with every weight moved by noise (a "trained" version)."""
    model = load_policy(src)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * (p.std() if p.numel() > 1 else 1.0))
    dst = Path(dst)
    model.save_pretrained(dst, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (Path(src) / name).exists():
            shutil.copy(Path(src) / name, dst / name)
    return dst


def peft_adapter(model_dir: str | Path, dst: str | Path, seed: int = 1, rank: int = 8):
    """A random (non-zero) PEFT adapter on q_proj and v_proj, saved to `dst`; returns the model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = load_policy(model_dir)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    model = get_peft_model(base, config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.mul_(3.0)  # big enough that greedy outputs differ from the base
    model.save_pretrained(dst)
    return model


def plain_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of a (PEFT) model's logits at the output positions (temperature 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


@asynccontextmanager
async def engine_for(kind: str, model_dir: Path, vllm_url: str | None):
    """The engine `kind` serving `model_dir`: embedded (in this process), serve (`verst serve`
    on this loop, through the SGLang client) or vllm (the session's server, through VllmClient).
    vLLM is restored to `model_dir` afterwards (its server outlives the test)."""
    if kind == "embedded":
        from verst.rollout.engines.embedded.engine import EmbeddedEngine

        engine = EmbeddedEngine.from_pretrained(model_dir, batch_wait_s=0.01)
        try:
            yield engine
        finally:
            await engine.close()
    elif kind == "serve":
        from serve_testlib import serve

        from verst.rollout.engines.sglang.client import SGLangClient

        async with serve(model_dir, info={"enable_lora": True}) as url:
            client = SGLangClient(url, abort_resend_s=0.1)
            try:
                yield client
            finally:
                await client.close()
    else:
        from verst.rollout.engines.vllm.client import VllmClient

        assert vllm_url is not None
        client = VllmClient(vllm_url, abort_resend_s=0.1, max_retries=1)
        try:
            yield client
        finally:
            await client.abort(None)
            await client.update_weights_from_disk(str(model_dir))
            await client.close()
