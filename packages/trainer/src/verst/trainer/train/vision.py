"""Vision inputs in the trainer: any layout of `verst.trainer.train.layout`, with images.

A layout moves tokens around (one packed row, padded rows, one row per shared prompt), so the
image-feature positions move too. Rather than teach every layout about images, the sequences
are laid out as *indices into a bank* (the concatenation of every sequence's tokens): the
layout's output then says, per position, which sequence token sits there, and the ids, the
targets and the image-feature rows are looked up through it. Two sequences count as sharing a
prompt only when their prompt ids AND the prompt's images (hash and place) are identical: the
bank gives them the same prompt indices, so `shared_prompt` groups exactly those and nothing
else (equal ids with different images stay apart).

`VisionBatch` travels on `PackedInputs.vision`; `PolicyLogprobs` then runs the decoder on
`inputs_embeds` from `MultimodalProcessor.embed_with_images` — the function the engine's
prefill uses, so both sides see the same ids and the same pixels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verst.rollout.multimodal.processor import MultimodalProcessor, PromptImage, image_key
from verst.trainer.train.layout import Layout, PackedInputs


@dataclass
class VisionBatch:
    """What `PolicyLogprobs` needs to put image features into a laid-out micro-batch."""

    processor: MultimodalProcessor
    flat_positions: torch.Tensor  # [num_feature_positions] indices into rows * width
    """Where image-feature rows go in the laid-out batch."""
    images: list[PromptImage]
    """The distinct images whose features are computed (once each)."""
    feature_rows: torch.Tensor  # [num_feature_positions]
    """Which row of those images' features goes to each position."""

    def embeds(self, model: Any, input_ids: torch.Tensor) -> torch.Tensor:
        """`[rows, width, hidden]` embeddings of `input_ids` with the image features in place.

        With gradients on, every trainable vision parameter (the projector; the tower when not
        frozen) joins the graph even in a micro-batch without images, with weight 0: under FSDP2
        each rank reduces the gradients its parameters have, so a rank whose micro-batches hold
        no image would otherwise send fewer gradients than the others (see docs/vlm.md)."""
        out = self.processor.embed_with_images(
            model, input_ids, self.flat_positions, self.images, self.feature_rows
        )
        if torch.is_grad_enabled():
            touch = [
                p.reshape(-1)[:1] for m in self.processor.family.vision_modules(model) for p in m.parameters()
            ]
            touch = [t for t in touch if t.requires_grad]
            if touch:
                out = out + 0.0 * torch.cat(touch).sum().to(out.dtype)
        return out

    @classmethod
    def empty(cls, processor: MultimodalProcessor) -> VisionBatch:
        """No images (a rank's empty micro-batch of a batch with images)."""
        none = torch.zeros(0, dtype=torch.long)
        return cls(processor, none, [], none)


def _prompt_images(images: Sequence[PromptImage], prompt_len: int) -> list[PromptImage]:
    return [im for im in images if im.offset < prompt_len]


def _bank_sequences(
    tokens: Sequence[Sequence[int]],
    response_lengths: Sequence[int],
    images: Sequence[Sequence[PromptImage]],
) -> tuple[list[list[int]], list[int]]:
    """Index sequences into the bank (identical text+image prompts share prompt indices) and the
    bank offset of each sequence."""
    offsets, at = [], 0
    for seq in tokens:
        offsets.append(at)
        at += len(seq)
    first: dict[tuple[Any, ...], int] = {}
    out = []
    for i, (seq, r) in enumerate(zip(tokens, response_lengths, strict=True)):
        p = len(seq) - r
        key = (tuple(seq[:p]), image_key(_prompt_images(images[i], p)))
        owner = first.setdefault(key, i)
        out.append([offsets[owner] + j for j in range(p)] + [offsets[i] + j for j in range(p, len(seq))])
    return out, offsets


def _feature_map(
    processor: MultimodalProcessor,
    tokens: Sequence[Sequence[int]],
    images: Sequence[Sequence[PromptImage]],
    offsets: Sequence[int],
) -> tuple[dict[int, int], list[PromptImage]]:
    """bank position → row in the features of the distinct images, and those images in order."""
    rows: dict[int, int] = {}
    distinct: dict[tuple[str, int], int] = {}  # image identity → first feature row
    order: list[PromptImage] = []
    total = 0
    for i, seq in enumerate(tokens):
        for im in images[i]:
            positions = processor.feature_positions(seq, [im])
            key = (im.ref.sha256, len(positions))
            if key not in distinct:
                distinct[key] = total
                order.append(im)
                total += len(positions)
            for k, pos in enumerate(positions):
                rows[offsets[i] + pos] = distinct[key] + k
    return rows, order


def lay_out_with_images(
    layout: Layout,
    processor: MultimodalProcessor,
    tokens: Sequence[Sequence[int]],
    response_lengths: Sequence[int],
    images: Sequence[Sequence[PromptImage]],
    *,
    pad_id: int = 0,
) -> PackedInputs:
    """`layout.build` of these sequences, with `vision` set for their images (see module doc)."""
    index_seqs, offsets = _bank_sequences(tokens, response_lengths, images)
    laid = layout.build(index_seqs, response_lengths, pad_id=-1)
    bank = torch.tensor([t for seq in tokens for t in seq], dtype=torch.long)  # [bank]
    where = laid.input_ids  # [rows, width] bank indices, -1 = padding
    ids = torch.where(where >= 0, bank[where.clamp(min=0)], torch.full_like(where, pad_id))
    rows, order = _feature_map(processor, tokens, images, offsets)
    flat_where = where.reshape(-1).tolist()
    positions = [f for f, b in enumerate(flat_where) if b in rows]
    vision = VisionBatch(
        processor,
        torch.tensor(positions, dtype=torch.long),
        order,
        torch.tensor([rows[flat_where[f]] for f in positions], dtype=torch.long),
    )
    return PackedInputs(
        input_ids=ids,
        position_ids=laid.position_ids,
        attention_mask=laid.attention_mask,
        gather_index=laid.gather_index,
        target_ids=bank[laid.target_ids],
        response_lengths=laid.response_lengths,
        layout=laid.layout,
        vision=vision,
    )


def processor_for(model_path: str) -> MultimodalProcessor:
    """The `MultimodalProcessor` of a checkpoint (its owner keeps it: its pixel cache is shared
    by every step)."""
    from transformers import AutoTokenizer

    return MultimodalProcessor.from_pretrained(model_path, AutoTokenizer.from_pretrained(model_path))


def lay_out_batch(
    layout: Layout,
    processor: MultimodalProcessor,
    tokens: Sequence[Sequence[int]],
    response_lengths: Sequence[int],
    images: Sequence[Sequence[dict[str, Any]]],
) -> PackedInputs:
    """`lay_out_with_images` over a train batch's rows (`Sample.images` recipe dicts)."""
    recipes = [[PromptImage.from_dict(d) for d in row] for row in images]
    return lay_out_with_images(layout, processor, tokens, response_lengths, recipes)
