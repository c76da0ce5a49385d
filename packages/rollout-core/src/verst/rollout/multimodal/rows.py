"""Images in dataset rows and chat messages → prompt text with `<image>` placeholders + images.

Two spellings, as users write them:

- a row key (`data.image_key`, default `images`): a list of image paths, base64 strings or
  `data:` URLs; the prompt text holds one `<image>` per image, in order (a prompt without any
  `<image>` gets them prepended);
- chat messages whose `content` is a list of OpenAI-style parts:
  `{"type": "text", "text": ...}`, `{"type": "image_url", "image_url": {"url": ...}}` (or
  `"image_url": "..."`), `{"type": "image", "image": ...}`; each image part becomes `<image>`
  in the message's text.

Every error names where it is (`file:line`, message and part) and how to fix it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verst.rollout.multimodal.families import IMAGE_PLACEHOLDER
from verst.rollout.multimodal.images import ImageError, ImageRef, ImageStore, resolve_image

Resolved = tuple[ImageRef, Any]
"""An image's reference and its decoded RGB pixels."""


def _part_image(part: dict[str, Any]) -> Any:
    if part.get("type") == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    return part.get("image")


def message_images(
    messages: list[Any], *, where: str, store: ImageStore | None, base_dir: Path | None
) -> tuple[list[Any], list[Resolved]]:
    """Messages with list content → string content with placeholders, and their images in order."""
    out: list[Any] = []
    images: list[Resolved] = []
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            out.append(msg)
            continue
        text = []
        for j, part in enumerate(content):
            at = f"{where}: message {i} part {j}"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                text.append(part["text"])
            elif kind in ("image_url", "image"):
                images.append(resolve_image(_part_image(part), what=at, store=store, base_dir=base_dir))
                text.append(IMAGE_PLACEHOLDER)
            else:
                raise ImageError(
                    f"{at}: a content part must be {{'type': 'text', 'text': ...}} or "
                    f"{{'type': 'image_url', 'image_url': {{'url': ...}}}}; got {str(part)[:80]!r}"
                )
        out.append({**msg, "content": "".join(text)})
    return out, images


def row_images(
    prompt: Any, values: Any, *, where: str, key: str, store: ImageStore | None, base_dir: Path | None
) -> tuple[Any, list[Resolved]]:
    """A row's `key` images → (the prompt with one placeholder per image, the images)."""
    if values is None:
        return prompt, []
    if isinstance(values, str):
        values = [values]
    if not isinstance(values, list):
        raise ImageError(f"{where}: {key!r} must be a list of image paths or base64 strings")
    images = [
        resolve_image(v, what=f"{where}: {key}[{k}]", store=store, base_dir=base_dir)
        for k, v in enumerate(values)
    ]
    if images and isinstance(prompt, str) and IMAGE_PLACEHOLDER not in prompt:
        prompt = IMAGE_PLACEHOLDER * len(images) + prompt
    return prompt, images


def image_store_for(data_path: Path, image_dir: str | None) -> ImageStore:
    """Where a dataset's base64 images are written: `image_dir`, else `<data file>.images/`."""
    return ImageStore(Path(image_dir) if image_dir else data_path.with_name(data_path.name + ".images"))


def tokenize_with_images(
    prompt: Any,
    images: list[Resolved],
    *,
    where: str,
    tokenizer: Any,
    vision: Any,
    apply_chat_template: bool,
    max_prompt_tokens: int | None,
) -> tuple[list[int], list[dict[str, Any]]]:
    """The prompt's model ids (images expanded, once, here) and its images' recipes (`Sample.images`)."""
    from verst.rollout.errors import DataError
    from verst.rollout.generate import prompt_token_ids

    if vision is None:
        raise DataError(
            f"{where}: the row has {len(images)} image(s) but the model is text-only; fix: train a "
            f"vision-language model (llava, idefics3, smolvlm) or remove the images"
        )
    if tokenizer is None:
        raise DataError(f"{where}: rows with images need the model's tokenizer to expand their image tokens")
    ids = prompt_token_ids(tokenizer, prompt, apply_chat_template)
    try:
        expanded = vision.expand(ids, images)
    except ImageError as exc:
        raise DataError(f"{where}: {exc}") from None
    n = len(expanded.input_ids)
    if max_prompt_tokens is not None and n >= max_prompt_tokens:
        raise DataError(
            f"{where}: with its {len(images)} image(s) expanded the prompt has {n} tokens and the context "
            f"holds {max_prompt_tokens}: no room for a response; fix: fewer or smaller images, a shorter "
            f"prompt, or a larger rollout.max_context_len"
        )
    return expanded.input_ids, [im.to_dict() for im in expanded.images]
