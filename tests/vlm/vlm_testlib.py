"""Train batches with images for the VLM trainer tests: GRPO groups whose prompts hold one image
each (expanded by the checkpoint's own `MultimodalProcessor`), fixed random responses."""

from __future__ import annotations

from pathlib import Path

import torch

from verst.rollout.sample import Sample, Status

RESPONSE_CHARS = "abcdefgh0123456789"


def image_groups(
    model_dir: str | Path,
    image_files: list[Path],
    *,
    groups: int = 3,
    per_group: int = 4,
    seed: int = 3,
    text_only: tuple[int, ...] = (),
) -> list[list[Sample]]:
    """`groups` groups of `per_group` samples; group g's prompt is `<image>` + text with image
    `g % len(image_files)` (groups in `text_only` get no image); responses of 1-5 characters."""
    from transformers import AutoTokenizer

    from verst.rollout.multimodal.processor import MultimodalProcessor

    tok = AutoTokenizer.from_pretrained(model_dir)
    proc = MultimodalProcessor.from_pretrained(model_dir, tok)
    chars = tok(RESPONSE_CHARS, add_special_tokens=False)["input_ids"]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(groups):
        if g in text_only:
            ids, images = tok(f"group {g}?")["input_ids"], None
        else:
            ref = proc.resolve(str(image_files[g % len(image_files)]), what="test image")
            ex = proc.expand(tok(f"<image> colour {g}?")["input_ids"], [ref])
            ids, images = ex.input_ids, [im.to_dict() for im in ex.images]
        group = []
        for j in range(per_group):
            r = 1 + (3 * g + j) % 5
            resp = [chars[int(k)] for k in torch.randint(len(chars), (r,), generator=gen)]
            group.append(
                Sample(
                    prompt=str(g),
                    tokens=ids + resp,
                    response_length=r,
                    reward=float((g * j) % 3),
                    status=Status.COMPLETED,
                    rollout_logprobs=[-2.0] * r,
                    group_index=g,
                    sample_index=per_group * g + j,
                    images=[dict(d) for d in images] if images else None,
                )
            )
        out.append(group)
    return out
