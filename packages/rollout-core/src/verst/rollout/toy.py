"""Tiny models and a character-level tokenizer that the project builds itself.

Nothing is downloaded: tests, examples and benchmarks make their model and tokenizer here and
save them in the ordinary Hugging Face layout, so every code path afterwards is the one users
take with their own checkpoints (`from_pretrained(path)`). Needs the `local` extra.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
CHARS = "0123456789=+-*/<>()[]{}.,:;!?'\" abcdefghijklmnopqrstuvwxyz\n#"
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def build_char_tokenizer(chars: str = CHARS) -> Any:
    """A real `PreTrainedTokenizerFast`: one token per character, plus pad/bos/eos/unk."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *dict.fromkeys(chars)))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def decoder_fields(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    max_position_embeddings: int = 256,
    pad_token_id: int = 0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
) -> dict[str, Any]:
    """The transformers config fields every tiny decoder here shares (Llama, the MoE families):
    full multi-head attention, untied embeddings."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_heads,
        "max_position_embeddings": max_position_embeddings,
        "pad_token_id": pad_token_id,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "tie_word_embeddings": False,
    }


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """`pad_token_id`, `bos_token_id` and `eos_token_id` of `tokenizer` (`decoder_fields`' keywords)."""
    return {
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def save_with_char_tokenizer(path: str | Path, build: Callable[..., Any]) -> Path:
    """`build(vocab_size, pad_token_id=, bos_token_id=, eos_token_id=)` with the char
    tokenizer's ids, then the model and the tokenizer saved to `path` (HF layout)."""
    path = Path(path)
    tokenizer = build_char_tokenizer()
    model = build(len(tokenizer), **special_token_ids(tokenizer))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def build_tiny_llama(
    vocab_size: int, *, intermediate_size: int | None = None, seed: int = 0, **decoder: Any
) -> Any:
    """A randomly initialised Llama-architecture causal LM (float32); `decoder`: the keywords of
    `decoder_fields` (`hidden_size`, `num_layers`, `num_heads`, token ids, ...)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = decoder_fields(vocab_size, **decoder)
    ffn = intermediate_size or 2 * fields["hidden_size"]
    config = LlamaConfig(**fields, intermediate_size=ffn, torch_dtype="float32")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def make_tiny_checkpoint(path: str | Path, *, seed: int = 0, **model_kwargs: Any) -> Path:
    """Build the char tokenizer and a tiny Llama and save both to `path` (HF layout)."""
    return save_with_char_tokenizer(path, functools.partial(build_tiny_llama, seed=seed, **model_kwargs))


def toy_groups(
    vocab: int,
    *,
    seed: int,
    groups: int = 3,
    size: int = 4,
    max_response: int = 5,
    reward: Callable[[int, int], float] = lambda g, j: float((g * j) % 3),
) -> list[list[Any]]:
    """Scored groups of random token ids for train-step tests and checks: group `g`, sample `j`
    has a prompt of `2 + (g + j) % 3` and a response of `1 + (3g + j) % max_response` tokens,
    reward `reward(g, j)`, rollout log-probs -2."""
    import torch

    from verst.rollout.sample import Sample, Status

    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(groups):
        group = []
        for j in range(size):
            p, r = 2 + (g + j) % 3, 1 + (3 * g + j) % max_response
            tokens = torch.randint(4, vocab, (p + r,), generator=gen).tolist()
            group.append(
                Sample(
                    prompt=str(g),
                    tokens=tokens,
                    response_length=r,
                    reward=reward(g, j),
                    status=Status.COMPLETED,
                    rollout_logprobs=[-2.0] * r,
                    group_index=g,
                    sample_index=size * g + j,
                )
            )
        out.append(group)
    return out
