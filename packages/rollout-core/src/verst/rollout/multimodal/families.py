"""Vision-language model families: how each turns pixels into image tokens and features.

A family is a class in `FAMILIES` (keyed by the checkpoint's `model_type`) that knows three
things about its architecture: the image processor that makes its pixels (transformers' PIL
one: no torchvision), the token ids one image becomes in the prompt (`expansion`), and how its
vision tower + projector turn pixels into one feature row per image token (`features`). Both
families below keep 1-D positions and replace each image token's embedding with a feature
row, so everything after the embedding (decoder, KV cache, positions, layouts) is the text
model's own.

- `llava`: LLaVA (a CLIP/SigLIP tower, an MLP projector); `<image>` × (patches [+ CLS]).
- `idefics3` / `smolvlm`: Idefics3 / SmolVLM (a SigLIP-like tower, pixel-shuffle connector),
  one global image per `<image>` (`do_image_splitting = false`):
  `<fake_token_around_image><global-img>` + `<image>` × image_seq_len + `<fake_token_around_image>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

IMAGE_PLACEHOLDER = "<image>"
"""The text a prompt holds where an image goes (before expansion); one token of the tokenizer."""


class VisionFamily(Protocol):
    """What verst needs of one VLM architecture (see the module doc)."""

    name: ClassVar[str]
    image_token_id: int
    """The id every image-feature position holds."""

    def pixels(self, image: Any) -> dict[str, torch.Tensor]:
        """One RGB image → the processor's tensors for it (no batch dim): e.g. `pixel_values` [3, H, W]."""
        ...

    def expansion(self, pixels: dict[str, torch.Tensor]) -> list[int]:
        """The token ids one image (these pixels) becomes in the prompt."""
        ...

    def features(self, model: Any, pixels: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """Feature rows `[sum of image tokens, hidden]` of these images, in order."""
        ...

    def vision_modules(self, model: Any) -> list[torch.nn.Module]:
        """The vision tower and projector (what `train.vision.freeze` freezes)."""
        ...


def _base(model: Any) -> Any:
    """The `*Model` inside a `*ForConditionalGeneration` (or the model itself); through PEFT too."""
    inner = getattr(model, "get_base_model", None)
    model = inner() if callable(inner) else model
    return getattr(model, "model", model)


def _dtype(module: torch.nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


@dataclass
class LlavaFamily:
    """LLaVA: each image is `n` copies of the image token, `n` = patches (+1 with the CLS row)."""

    name: ClassVar[str] = "llava"
    image_token_id: int
    processor: Any
    """transformers' `LlavaImageProcessorPil`."""
    patch_size: int
    keep_cls: bool
    """`vision_feature_select_strategy = 'full'` keeps the CLS row (one more token)."""
    feature_layer: Any
    strategy: str

    @classmethod
    def build(cls, config: Any, processor: Any) -> LlavaFamily:
        strategy = config.vision_feature_select_strategy
        return cls(
            int(config.image_token_id),
            processor,
            int(config.vision_config.patch_size),
            strategy == "full",
            config.vision_feature_layer,
            strategy,
        )

    def pixels(self, image: Any) -> dict[str, torch.Tensor]:
        out = self.processor(images=[image], return_tensors="pt")
        return {"pixel_values": out["pixel_values"][0]}  # [3, H, W]

    def expansion(self, pixels: dict[str, torch.Tensor]) -> list[int]:
        _, h, w = pixels["pixel_values"].shape
        n = (h // self.patch_size) * (w // self.patch_size) + (1 if self.keep_cls else 0)
        return [self.image_token_id] * n

    def features(self, model: Any, pixels: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        base = _base(model)
        values = torch.stack([p["pixel_values"] for p in pixels]).to(base.device, _dtype(base.vision_tower))
        out = base.get_image_features(
            pixel_values=values,
            vision_feature_layer=self.feature_layer,
            vision_feature_select_strategy=self.strategy,
        ).pooler_output
        return torch.cat(list(out), dim=0)  # [images * tokens, hidden]

    def vision_modules(self, model: Any) -> list[torch.nn.Module]:
        base = _base(model)
        return [base.vision_tower, base.multi_modal_projector]


@dataclass
class Idefics3Family:
    """Idefics3 / SmolVLM with one global image per `<image>` (no tiling)."""

    name: ClassVar[str] = "idefics3"
    image_token_id: int
    processor: Any
    """transformers' `Idefics3ImageProcessorPil` (`do_image_splitting = false`)."""
    around_id: int
    """`<fake_token_around_image>`."""
    global_id: int
    """`<global-img>`."""
    patch_size: int
    scale_factor: int

    @classmethod
    def build(cls, config: Any, processor: Any, tokenizer: Any) -> Idefics3Family:
        if getattr(processor, "do_image_splitting", False):
            raise ValueError(
                "idefics3/smolvlm images are supported as one global image: set "
                '"do_image_splitting": false in the checkpoint\'s preprocessor_config.json'
            )
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<fake_token_around_image>", "<global-img>")}
        unk = getattr(tokenizer, "unk_token_id", None)
        missing = [t for t, i in ids.items() if i is None or i == unk]
        if missing:
            raise ValueError(f"the tokenizer has no {missing} token(s), which idefics3 prompts need")
        return cls(
            int(config.image_token_id),
            processor,
            ids["<fake_token_around_image>"],
            ids["<global-img>"],
            int(config.vision_config.patch_size),
            int(config.scale_factor),
        )

    def pixels(self, image: Any) -> dict[str, torch.Tensor]:
        out = self.processor(images=[[image]], return_tensors="pt")
        values = out["pixel_values"][0, 0]  # [3, S, S]
        mask = out.get("pixel_attention_mask")
        px = {"pixel_values": values}
        if mask is not None:
            px["pixel_attention_mask"] = mask[0, 0]  # [S, S]
        return px

    def expansion(self, pixels: dict[str, torch.Tensor]) -> list[int]:
        _, h, w = pixels["pixel_values"].shape
        n = (h // self.patch_size) * (w // self.patch_size) // (self.scale_factor**2)
        return [self.around_id, self.global_id, *([self.image_token_id] * n), self.around_id]

    def features(self, model: Any, pixels: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        base = _base(model)
        values = torch.stack([p["pixel_values"] for p in pixels])[:, None]  # [images, 1, 3, S, S]
        mask = None
        if all("pixel_attention_mask" in p for p in pixels):
            mask = torch.stack([p["pixel_attention_mask"] for p in pixels])[:, None].to(base.device)
        out = base.get_image_features(
            pixel_values=values.to(base.device, _dtype(base.vision_model)), pixel_attention_mask=mask
        ).pooler_output  # [images, tokens, hidden]
        return out.reshape(-1, out.shape[-1])

    def vision_modules(self, model: Any) -> list[torch.nn.Module]:
        base = _base(model)
        return [base.vision_model, base.connector]


_PIL_PROCESSORS = {
    "llava": ("transformers.models.llava.image_processing_pil_llava", "LlavaImageProcessorPil"),
    "idefics3": ("transformers.models.idefics3.image_processing_pil_idefics3", "Idefics3ImageProcessorPil"),
}

FAMILIES: dict[str, str] = {"llava": "llava", "idefics3": "idefics3", "smolvlm": "idefics3"}
"""`model_type` → the family that serves it (a new family is a class plus entries here)."""


def is_vision_config(config: Any) -> bool:
    """Whether a checkpoint config is one of the supported VLM families."""
    return getattr(config, "model_type", None) in FAMILIES


def image_processor(family: str, model_dir: str | None) -> Any:
    """The family's PIL image processor, from `model_dir`'s preprocessor_config.json when it has one."""
    import importlib
    from pathlib import Path

    module, name = _PIL_PROCESSORS[family]
    cls = getattr(importlib.import_module(module), name)
    if model_dir is None:
        return cls()
    if not (Path(model_dir) / "preprocessor_config.json").is_file():
        raise ValueError(
            f"{model_dir} has no preprocessor_config.json: the image processor's settings (image size, "
            f"normalisation) would be guessed; copy it from the checkpoint the model came from"
        )
    return cls.from_pretrained(model_dir)


def build_family(config: Any, tokenizer: Any, processor: Any) -> VisionFamily:
    """The `VisionFamily` of a checkpoint config (`ValueError` for text-only / unknown types)."""
    kind = FAMILIES.get(getattr(config, "model_type", ""))
    if kind is None:
        raise ValueError(
            f"model_type {getattr(config, 'model_type', None)!r} takes no images; vision families: "
            f"{', '.join(sorted(FAMILIES))}"
        )
    if kind == "llava":
        return LlavaFamily.build(config, processor)
    return Idefics3Family.build(config, processor, tokenizer)


def auto_model_class(path: str) -> Any:
    """transformers' auto class for a checkpoint: image-text-to-text for the VLM families
    (`AutoModelForCausalLM` does not map them), causal LM otherwise."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError):  # let from_pretrained raise its own error about the path
        return transformers.AutoModelForCausalLM
    if is_vision_config(config):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM
