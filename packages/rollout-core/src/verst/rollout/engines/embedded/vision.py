"""Vision prefill for the embedded engine: a prompt's image features enter its embeddings.

The request carries the already expanded ids and one `PromptImage` recipe per image
(`verst.rollout.multimodal`); the prefill forward then runs on `inputs_embeds` built by the
same `MultimodalProcessor.embed_with_images` the trainer uses. Decode steps feed plain token
ids (an image never appears in a generated token).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def prefill_kwargs(
    vision: Any, model: Any, ids: torch.Tensor, rows: Sequence[Any]
) -> dict[str, torch.Tensor]:
    """`input_ids=ids`, or `inputs_embeds` with the images of `rows` (left-padded in `ids`)."""
    if vision is None or not any(r.request.images for r in rows):
        return {"input_ids": ids}
    width = ids.shape[1]
    positions: list[int] = []
    images: list[Any] = []
    for i, r in enumerate(rows):
        pad = width - r.prompt_len
        for p in vision.feature_positions(r.request.input_ids, r.request.images):
            positions.append(i * width + pad + p)
        images.extend(r.request.images)
    flat = torch.tensor(positions, dtype=torch.long, device=ids.device)
    return {"inputs_embeds": vision.embed_with_images(model, ids, flat, images)}


def image_problem(vision: Any, input_ids: list[int], images: Sequence[Any]) -> str | None:
    """Why a request's images cannot be served (None when they can)."""
    if not images:
        return None
    if vision is None:
        return (
            f"{len(images)} image(s) were given to a text-only model; serve a vision-language checkpoint "
            "(llava, idefics3, smolvlm) or send no images"
        )
    from verst.rollout.multimodal.images import ImageError

    try:
        vision.feature_positions(input_ids, images)
    except ImageError as exc:
        return str(exc)
    return None


def unreadable_image(vision: Any, images: Sequence[Any]) -> str | None:
    """Why one request's images cannot be rebuilt now (a file that vanished or changed since the
    request was expanded), else None. Checked per request at admission so that one bad image
    fails its own request, not every request of the same prefill; the pixels stay in the
    processor's cache for the prefill that follows."""
    if vision is None or not images:
        return None
    from verst.rollout.multimodal.images import ImageError

    try:
        for image in images:
            vision.rebuild(image)
    except ImageError as exc:
        return str(exc)
    return None
