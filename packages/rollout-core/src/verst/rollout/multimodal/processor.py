"""The one place image tokens are expanded, and the one place image features enter embeddings.

`MultimodalProcessor.expand` turns prompt ids holding one placeholder per image (`<image>`) into
the model's ids (each placeholder → the family's expansion) and records, per image, a
`PromptImage`: where its bytes are (`ImageRef`), where its tokens sit in the sequence and the
processor's output shapes — the bounded recipe a `Sample` keeps instead of pixels. The engine
gets these ids and recipes with the request; the trainer gets the sample's tokens and recipes;
both call `embed_with_images`, which rebuilds the pixels from the recipe (checked: same hash,
same shapes), runs the vision tower, and writes one feature row into each image-token position.
So the ids and pixel inputs are identical on both sides by construction, and tested.

Expanding ids that were already expanded fails (the placeholder count no longer equals the
image count), which is the double-expansion bug other frameworks hit.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from verst.rollout.multimodal.families import (
    IMAGE_PLACEHOLDER,
    VisionFamily,
    build_family,
    image_processor,
    is_vision_config,
)
from verst.rollout.multimodal.images import ImageError, ImageRef, ImageStore, load_ref, resolve_image


class TextOnlyModelError(ValueError):
    """Images were given to a model that takes none."""


@dataclass(frozen=True)
class PromptImage:
    """One image in a token sequence: its bytes' reference, its token span, its pixel shapes."""

    ref: ImageRef
    offset: int
    """Index in the sequence of the first token of this image's expansion."""
    length: int
    """Number of tokens of the expansion (the image-feature positions are the image-token ids in it)."""
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    """The processor's output tensors' names and shapes (checked when pixels are rebuilt)."""
    placeholder: int = -1
    """The placeholder id the span replaced (`<image>`): what SGLang's wire form holds instead."""
    pixels: dict[str, torch.Tensor] | None = field(default=None, compare=False, repr=False)
    """The pixels, when at hand in this process (never serialized; rebuilt from `ref` otherwise)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON form (what `Sample.images` holds): no pixels."""
        return {
            **self.ref.to_dict(),
            "offset": self.offset,
            "length": self.length,
            "shapes": {k: list(v) for k, v in self.shapes},
            "placeholder": self.placeholder,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PromptImage:
        shapes = tuple((k, tuple(int(x) for x in v)) for k, v in data["shapes"].items())
        ref = ImageRef(data["path"], data["sha256"])
        return cls(ref, int(data["offset"]), int(data["length"]), shapes, int(data.get("placeholder", -1)))

    def shifted(self, by: int) -> PromptImage:
        """The same image `by` positions later (a prompt's images inside a longer sequence)."""
        return PromptImage(
            self.ref, self.offset + by, self.length, self.shapes, self.placeholder, self.pixels
        )


def image_key(images: Sequence[PromptImage | dict[str, Any]] | None) -> tuple[tuple[str, int], ...]:
    """What must also match for two equal id sequences to be the same input: (hash, offset) per image."""
    out = []
    for im in images or ():
        if isinstance(im, dict):
            out.append((str(im["sha256"]), int(im["offset"])))
        else:
            out.append((im.ref.sha256, im.offset))
    return tuple(out)


@dataclass(frozen=True)
class Expanded:
    """`MultimodalProcessor.expand`'s result."""

    input_ids: list[int]
    """The model's ids: each placeholder replaced by its image's expansion."""
    images: list[PromptImage]
    """One per image, in sequence order (offsets include the `offset` passed to `expand`)."""


class MultimodalProcessor:
    """Image preprocessing + token expansion + feature merge for one VLM checkpoint."""

    PIXEL_CACHE = 512
    """Rebuilt pixels kept per process (by image hash): a GRPO group's samples share one image."""

    def __init__(self, family: VisionFamily, placeholder_id: int, store: ImageStore | None = None) -> None:
        self.family = family
        self.placeholder_id = placeholder_id
        """The id of `<image>` in the tokenizer: one per image before expansion."""
        self.store = store
        """Where images that arrive without a file (base64, an environment's rendered image) are
        written, so the trainer can re-read them (None: such images are refused)."""
        self._cache: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, tokenizer: Any, config: Any = None, *, store: ImageStore | None = None
    ) -> MultimodalProcessor:
        """The processor of a VLM checkpoint directory; `TextOnlyModelError` for a text-only one."""
        if config is None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(str(model_dir))
        if not is_vision_config(config):
            raise TextOnlyModelError(
                f"the model ({getattr(config, 'model_type', '?')}, {model_dir}) is text-only and takes no "
                f"images; fix: use a vision-language checkpoint (llava, idefics3, smolvlm) or drop the images"
            )
        kind = "llava" if config.model_type == "llava" else "idefics3"
        family = build_family(config, tokenizer, image_processor(kind, str(model_dir)))
        placeholder = tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER)
        if placeholder is None or placeholder == getattr(tokenizer, "unk_token_id", None):
            raise ValueError(f"the tokenizer of {model_dir} has no {IMAGE_PLACEHOLDER!r} token")
        return cls(family, int(placeholder), store)

    @property
    def image_token_id(self) -> int:
        return self.family.image_token_id

    def resolve(self, value: Any, *, what: str) -> tuple[ImageRef, Any]:
        """A path, base64 text, data URL or `PIL.Image` → (reference, RGB image)."""
        if isinstance(value, str):
            return resolve_image(value, what=what, store=self.store)
        if not hasattr(value, "save"):
            raise ImageError(
                f"{what}: an image must be a PIL image, a path or base64; got {type(value).__name__}"
            )
        if self.store is None:
            raise ImageError(f"{what}: an in-memory image needs an image store (rollout.image_dir)")
        buf = io.BytesIO()
        value.convert("RGB").save(buf, format="PNG")
        ref = self.store.put(buf.getvalue())
        return ref, value.convert("RGB")

    # ---- the expansion ------------------------------------------------------------------
    def pixels(self, image: Any, ref: ImageRef) -> dict[str, torch.Tensor]:
        """The processor's tensors for a decoded image (cached by its hash)."""
        hit = self._cache.get(ref.sha256)
        if hit is not None:
            self._cache.move_to_end(ref.sha256)
            return hit
        px = self.family.pixels(image)
        self._cache[ref.sha256] = px
        if len(self._cache) > self.PIXEL_CACHE:
            self._cache.popitem(last=False)
        return px

    def expand(
        self, ids: Sequence[int], images: Sequence[tuple[ImageRef, Any]], *, offset: int = 0
    ) -> Expanded:
        """Replace the i-th placeholder in `ids` with image i's expansion.

        `images` are (reference, decoded image) pairs; `offset` is where `ids` start in the
        whole sequence (a multi-turn observation appended after earlier tokens).
        """
        slots = [i for i, t in enumerate(ids) if t == self.placeholder_id]
        if len(slots) != len(images):
            raise ImageError(
                f"the prompt has {len(slots)} {IMAGE_PLACEHOLDER} placeholder(s) but {len(images)} image(s) "
                f"were given; fix: put exactly one {IMAGE_PLACEHOLDER} where each image goes (ids that "
                f"were already expanded cannot be expanded again)"
            )
        out: list[int] = []
        recipes: list[PromptImage] = []
        start = 0
        for slot, (ref, image) in zip(slots, images, strict=True):
            out.extend(ids[start:slot])
            px = self.pixels(image, ref)
            span = self.family.expansion(px)
            shapes = tuple((k, tuple(v.shape)) for k, v in px.items())
            recipes.append(PromptImage(ref, offset + len(out), len(span), shapes, self.placeholder_id, px))
            out.extend(span)
            start = slot + 1
        out.extend(ids[start:])
        return Expanded(out, recipes)

    def rebuild(self, image: PromptImage) -> dict[str, torch.Tensor]:
        """The pixels of a recipe: its own, or re-read from its file (hash and shapes checked)."""
        if image.pixels is not None:
            return image.pixels
        px = self._cache.get(image.ref.sha256)
        if px is None:
            px = self.pixels(load_ref(image.ref), image.ref)
        got = tuple((k, tuple(v.shape)) for k, v in px.items())
        if got != image.shapes:
            raise ImageError(
                f"image {image.ref.path!r}: the processor now gives shapes {dict(got)}, the sample was "
                f"made with {dict(image.shapes)}; use the same preprocessor_config.json on both sides"
            )
        return px

    # ---- the merge ----------------------------------------------------------------------
    def feature_positions(self, ids: Sequence[int], images: Sequence[PromptImage]) -> list[int]:
        """Indices into `ids` of the image-feature positions of `images`, in order (checked)."""
        out: list[int] = []
        for im in images:
            span = ids[im.offset : im.offset + im.length]
            if len(span) != im.length:
                raise ImageError(
                    f"image {im.ref.path!r} spans tokens {im.offset}..{im.offset + im.length - 1} but "
                    f"the sequence has {len(ids)} tokens"
                )
            hits = [im.offset + j for j, t in enumerate(span) if t == self.image_token_id]
            if not hits:
                raise ImageError(f"image {im.ref.path!r}: no image tokens at offset {im.offset}")
            out.extend(hits)
        return out

    def embed_with_images(
        self,
        model: Any,
        input_ids: torch.Tensor,  # [rows, width]
        flat_positions: torch.Tensor,  # [num_feature_rows] indices into rows * width
        images: Sequence[PromptImage],
        feature_rows: torch.Tensor | None = None,  # [num_feature_rows] rows of the images' features
    ) -> torch.Tensor:
        """Token embeddings `[rows, width, hidden]` with the images' feature rows at
        `flat_positions`: row j of the images' features (all image tokens of `images`, in order)
        goes to `flat_positions[j]`, or `feature_rows[j]` of them goes there when given (a layout
        that repeats or reorders image tokens)."""
        embed = model.get_input_embeddings()
        embeds = embed(input_ids)  # [rows, width, hidden]
        if not images:
            return embeds
        feats = self.family.features(model, [self.rebuild(im) for im in images]).to(embeds.dtype)
        if feature_rows is not None:
            feats = feats.index_select(0, feature_rows.to(feats.device))
        if feats.shape[0] != flat_positions.numel():
            raise ImageError(
                f"{feats.shape[0]} image feature rows for {flat_positions.numel()} image-token positions"
            )
        flat = embeds.reshape(-1, embeds.shape[-1])
        flat = flat.index_copy(0, flat_positions.to(flat.device), feats)  # out of place: autograd-safe
        return flat.reshape(embeds.shape)
