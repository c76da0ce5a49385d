"""Tiny vision-language checkpoints the project builds itself (random init, nothing downloaded).

`make_tiny_vlm_checkpoint(path, family=...)` saves a real transformers VLM (LLaVA or Idefics3)
at a tiny size, the project's character tokenizer with the family's image tokens added, and the
family's PIL image processor config — the ordinary layout a user's checkpoint has, so every
code path afterwards is the one real checkpoints take.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verst.rollout.toy import build_char_tokenizer, decoder_fields, special_token_ids

IMAGE_TOKENS = ("<image>", "<fake_token_around_image>", "<global-img>")
"""Tokens the tiny VLM tokenizers add (the first is the placeholder and the image token)."""
TOY_FAMILIES = ("llava", "idefics3")


def build_vlm_tokenizer() -> Any:
    """The char tokenizer plus `IMAGE_TOKENS` as whole special tokens."""
    tokenizer = build_char_tokenizer()
    tokenizer.add_tokens(list(IMAGE_TOKENS), special_tokens=True)
    return tokenizer


def _text_config(tokenizer: Any, hidden: int, layers: int, heads: int, max_positions: int) -> Any:
    from transformers import LlamaConfig

    fields = decoder_fields(
        len(tokenizer),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        max_position_embeddings=max_positions,
        **special_token_ids(tokenizer),
    )
    return LlamaConfig(**fields, intermediate_size=2 * hidden)


def _vision(hidden: int, image_size: int, patch_size: int) -> dict[str, Any]:
    return {
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": image_size,
        "patch_size": patch_size,
    }


def build_tiny_vlm(
    family: str,
    tokenizer: Any,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    vision_hidden: int = 32,
    image_size: int = 28,
    patch_size: int = 7,
    max_position_embeddings: int = 256,
    seed: int = 0,
) -> tuple[Any, Any]:
    """(model, image processor) of a randomly initialised tiny VLM of `family` (float32).

    `num_heads` of the language model: vLLM-CPU's paged attention takes head sizes 32, 64, 80, ...
    only, so a checkpoint for it needs `hidden_size / num_heads >= 32` (e.g. 64 / 2)."""
    import torch

    if family not in TOY_FAMILIES:
        raise ValueError(f"unknown toy VLM family {family!r}; choose one of {', '.join(TOY_FAMILIES)}")
    text = _text_config(tokenizer, hidden_size, num_layers, num_heads, max_position_embeddings)
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    torch.manual_seed(seed)
    if family == "llava":
        from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration
        from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

        config = LlavaConfig(
            vision_config=CLIPVisionConfig(**_vision(vision_hidden, image_size, patch_size)),
            text_config=text,
            image_token_id=image_id,
            projector_hidden_act="gelu",
            vision_feature_layer=-1,
            vision_feature_select_strategy="default",
            image_seq_length=(image_size // patch_size) ** 2,
            tie_word_embeddings=False,
        )
        processor = LlavaImageProcessorPil(
            size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
        )
        return LlavaForConditionalGeneration(config), processor
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    config = Idefics3Config(
        vision_config=_vision(vision_hidden, image_size, patch_size),
        text_config=text.to_dict(),
        image_token_id=image_id,
        scale_factor=2,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    processor = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": image_size},
        max_image_size={"longest_edge": image_size},
    )
    return Idefics3ForConditionalGeneration(config), processor


def make_tiny_vlm_checkpoint(
    path: str | Path, *, family: str = "llava", seed: int = 0, **kwargs: Any
) -> Path:
    """Build and save a tiny VLM, its tokenizer and its image processor config to `path`."""
    path = Path(path)
    tokenizer = build_vlm_tokenizer()
    model, processor = build_tiny_vlm(family, tokenizer, seed=seed, **kwargs)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    processor.save_pretrained(path)
    _hf_processor(family, model.config, processor, tokenizer).save_pretrained(path)
    return path


def _hf_processor(family: str, config: Any, image_processor: Any, tokenizer: Any) -> Any:
    """The family's transformers multimodal processor with the checkpoint's own expansion
    settings (`processor_config.json`), which other engines read to expand images (vLLM's
    Transformers backend counts image tokens with it); verst's own expansion is `families`."""
    if family == "llava":
        from transformers import LlavaProcessor

        return LlavaProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=config.vision_config.patch_size,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
            num_additional_image_tokens=1,  # CLIP's CLS row ("default" drops it again)
            image_token="<image>",
        )
    from transformers import Idefics3Processor

    vision = config.vision_config
    seq_len = (vision.image_size // vision.patch_size) ** 2 // config.scale_factor**2
    return Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=seq_len)
