"""Images on the HTTP wire, in sglang 0.5.23's `/generate` form (no torch needed here).

SGLang's `GenerateReqInput.image_data` takes, per request, one image or a list of images, each a
file name, URL or base64 string; with `input_ids` its multimodal processor decodes the ids, finds
one image placeholder per image and expands them itself (`base_processor.load_mm_data`). So
the wire carries the *collapsed* ids — each image's expanded span back to its one placeholder —
and the images as data URLs; the receiving side expands again. `verst serve` does the same with
the model's `MultimodalProcessor`, which gives back exactly the ids the sender had (tested).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def collapse_ids(ids: Sequence[int], images: Sequence[Any]) -> list[int]:
    """Each image's span (`PromptImage.offset`, `.length`) → its `.placeholder` id."""
    out: list[int] = []
    start = 0
    for im in sorted(images, key=lambda im: im.offset):
        if im.placeholder < 0:
            raise ValueError("an image recipe without its placeholder id cannot go over the wire")
        out.extend(ids[start : im.offset])
        out.append(im.placeholder)
        start = im.offset + im.length
    out.extend(ids[start:])
    return out


def image_data(images: Sequence[Any]) -> list[str]:
    """The images as `data:` URLs of their files' bytes (the receiver never needs our paths)."""
    out = []
    for im in images:
        if not im.ref.path:
            raise ValueError(
                f"image {im.ref.sha256[:12]} has no file to send; give images as files or base64"
            )
        data = base64.b64encode(Path(im.ref.path).read_bytes()).decode("ascii")
        out.append(f"data:image/png;base64,{data}")
    return out


def images_of(body: dict[str, Any], n: int, *, batch: bool) -> list[list[Any]]:
    """A /generate body's `image_data` → a list of images per prompt (sglang's forms)."""
    raw = body.get("image_data")
    if raw is None or raw == []:
        return [[] for _ in range(n)]
    if not batch:
        return [raw if isinstance(raw, list) else [raw]]
    if not isinstance(raw, list) or len(raw) != n:
        raise ValueError(
            "image_data of a batch must be a list with one entry (an image or a list) per prompt"
        )
    return [[] if x is None else (x if isinstance(x, list) else [x]) for x in raw]
