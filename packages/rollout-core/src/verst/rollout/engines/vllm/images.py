"""Images on vLLM's token-in / token-out route (vllm 0.32, `POST /inference/v1/generate`).

vLLM's way, read from its source (`entrypoints/scale_out/token_in_token_out/{protocol,serving}.py`,
`multimodal/processing/processor.py`, `model_executor/models/llava.py`):

- The request's `content_parts` (`[{"type": "image_url", "url": ...}]`, data URLs work without
  any media flag) go beside `token_ids`; the server decodes them, runs the checkpoint's own HF
  processor on the pixels, and **expands the prompt itself**: each image's `PromptReplacement`
  (LLaVA: the target `[image_token_index]` becomes `[image_token_index] * n`; Idefics3: the
  `<fake_token_around_image><global-img><image>*n<fake_token_around_image>` block) replaces the
  next placeholder. It always applies the replacement, so ids already expanded would be expanded
  again (each image's first placeholder grows, the rest stay): the wire carries the *collapsed*
  ids, each image's span back to its one placeholder (`verst.rollout.multimodal.wire`), as for
  SGLang.
- `return_token_ids: true` makes the answer carry `prompt_token_ids` (the ids after vLLM's
  expansion, what it scores) and `mm_placeholders` (`{"image": [{offset, length}]}`, one range
  per image over the whole replacement). The client checks both against the request's ids and
  image spans (verst's `MultimodalProcessor.expand`, which the trainer uses): a mismatch is an
  `EngineError` naming the first differing position, never a silently misaligned sample.

The other multimodal form of that route, `features` (pre-processed tensors as base64
`MultiModalKwargsItem`s in vLLM's msgpack encoding, plus hashes and placeholder ranges), is
vLLM-internal serialisation meant for its own render servers; verst does not use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from verst.rollout.engine import EngineError
from verst.rollout.multimodal.wire import collapse_ids, image_data


def image_fields(input_ids: Sequence[int], images: Sequence[Any]) -> dict[str, Any]:
    """The body fields of a request with images: collapsed `token_ids`, `content_parts`, and
    `return_token_ids` (so the answer shows the ids vLLM expanded)."""
    return {
        "token_ids": collapse_ids(input_ids, images),
        "content_parts": [{"type": "image_url", "url": url} for url in image_data(images)],
        "return_token_ids": True,
    }


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def check_expansion(data: dict[str, Any], input_ids: Sequence[int], images: Sequence[Any]) -> None:
    """vLLM's expanded prompt (`prompt_token_ids`, `mm_placeholders`) equals verst's ids and
    image spans; `EngineError` otherwise."""
    got = data.get("prompt_token_ids")
    if got is None:
        raise EngineError(
            "vLLM returned no prompt_token_ids for an image request (sent return_token_ids=true): "
            "cannot check that it expanded the images as the trainer does"
        )
    want = list(input_ids)
    if list(got) != want:
        i = _first_difference(got, want)
        raise EngineError(
            f"vLLM expanded the image placeholders to {len(got)} ids, verst's processor to {len(want)}; "
            f"first difference at position {i} (vLLM {list(got[i : i + 4])}, verst {want[i : i + 4]}). "
            "fix: serve the same checkpoint directory (preprocessor_config.json, vision config) to both"
        )
    ranges = (data.get("mm_placeholders") or {}).get("image") or []
    spans = [(int(r["offset"]), int(r["length"])) for r in ranges]
    expected = sorted((int(im.offset), int(im.length)) for im in images)
    if sorted(spans) != expected:
        raise EngineError(
            f"vLLM placed the images at (offset, length) {spans}, verst's processor at {expected}"
        )
