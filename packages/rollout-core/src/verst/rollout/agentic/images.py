"""Images in environment observations: expanded once, where the observation is tokenized.

An `Observation` with `images` holds one `<image>` placeholder per image; its ids go through
the model's `MultimodalProcessor.expand` at the offset they are appended at, and the images'
recipes join `sample.images`. The observation's tokens — image tokens included — get loss mask
0 like every observation token; the engine (next turn's request) and the trainer (the sample)
see the same ids and the same recipes.
"""

from __future__ import annotations

from typing import Any

from verst.rollout.agentic.environment import Observation


def expand_observation(
    vision: Any, obs: Observation | None, ids: list[int], *, offset: int
) -> tuple[list[int], list[dict[str, Any]]]:
    """(the observation's model ids, its images' recipes) — unchanged ids when it has no images."""
    if obs is None or not obs.images:
        return ids, []
    if vision is None:
        raise ValueError(
            f"an environment observation holds {len(obs.images)} image(s) but the model is text-only; "
            "train a vision-language model or return text observations"
        )
    resolved = [vision.resolve(im, what=f"observation image {k}") for k, im in enumerate(obs.images)]
    expanded = vision.expand(ids, resolved, offset=offset)
    return expanded.input_ids, [im.to_dict() for im in expanded.images]
