"""Build the colour_square example: synthetic images, a tiny LLaVA, and its SFT warm start.

Why: a vision-language RL task that learns on CPU in minutes, with everything made here
(images, tokenizer, model); nothing is downloaded. Each image is a 28x28 picture with one
coloured square (red, green, blue or yellow; random size, place and background); the prompt is
`<image>colour?` and the answer the square's colour.

    uv run python examples/colour_square/make_example.py      # 200 SFT steps; ~55 min at load 15-20 here

Writes `data/images/*.png`, `data/train.jsonl`, `data/eval.jsonl` (held-out images),
`model/init/` (random init) and `model/warm_start/`: a *mixed-rule* SFT in which each target is
the true colour with probability `RIGHT` and "red" otherwise — the warm start answers "red"
greedily (right only on red squares) but samples the true colour often enough for GRPO to
select it. The SFT loop uses the project's trainer pieces (`lay_out_with_images`,
`PolicyLogprobs`), so its inputs are the ones `verst train` builds.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 60, 230), "yellow": (235, 220, 40)}
SIZE = 28
N_TRAIN, N_EVAL = 800, 200
RIGHT = 0.35
"""Probability that an SFT target is the true colour (else "red")."""
PROMPT = "<image>colour?"


def draw(rng: random.Random) -> tuple[np.ndarray, str]:
    """One image (HxWx3 uint8) with a square of a random colour, and that colour's name."""
    name = rng.choice(sorted(COLOURS))
    bg = rng.choice([(0, 0, 0), (255, 255, 255), (128, 128, 128), (60, 40, 20)])
    img = np.empty((SIZE, SIZE, 3), dtype=np.uint8)
    img[:] = bg
    side = rng.randint(8, 16)
    y, x = rng.randint(0, SIZE - side), rng.randint(0, SIZE - side)
    img[y : y + side, x : x + side] = COLOURS[name]
    return img, name


def write_data(root: Path, seed: int = 0) -> None:
    from PIL import Image

    rng = random.Random(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    for split, n in (("train", N_TRAIN), ("eval", N_EVAL)):
        rows = []
        for i in range(n):
            img, name = draw(rng)
            rel = f"images/{split}_{i:04d}.png"
            Image.fromarray(img).save(root / rel)
            rows.append({"prompt": PROMPT, "images": [rel], "label": name})
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def sft(init: Path, out: Path, data: Path, *, steps: int = 300, batch: int = 64, seed: int = 0) -> None:
    """The mixed-rule warm start (module doc), trained with the project's log-prob path."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from verst.rollout.config import DataConfig
    from verst.rollout.data import load_prompt_samples
    from verst.rollout.multimodal.processor import MultimodalProcessor, PromptImage
    from verst.trainer.train.layout import LAYOUTS
    from verst.trainer.train.logprobs import PolicyLogprobs
    from verst.trainer.train.vision import lay_out_with_images

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(init)
    vision = MultimodalProcessor.from_pretrained(init, tok)
    model = AutoModelForImageTextToText.from_pretrained(init).train()
    samples = load_prompt_samples(
        DataConfig(path=str(data / "train.jsonl"), shuffle=False), tokenizer=tok, vision=vision
    )
    wrapper = PolicyLogprobs(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    rng = random.Random(seed)
    for step in range(steps):
        picked = rng.sample(samples, batch)
        answers = [s.label if rng.random() < RIGHT else "red" for s in picked]
        resp = [tok(a)["input_ids"] + [tok.eos_token_id] for a in answers]
        tokens = [s.tokens + r for s, r in zip(picked, resp, strict=True)]
        images = [[PromptImage.from_dict(d) for d in s.images] for s in picked]
        inputs = lay_out_with_images(LAYOUTS["padded"], vision, tokens, [len(r) for r in resp], images)
        lp, _ = wrapper(inputs)
        loss = -lp.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"sft step {step} loss {loss.item():.4f}", flush=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    vision.family.processor.save_pretrained(out)


def main() -> None:
    import torch

    from verst.rollout.multimodal.toy import make_tiny_vlm_checkpoint

    torch.set_num_threads(2)
    data = HERE / "data"
    write_data(data)
    init = make_tiny_vlm_checkpoint(
        HERE / "model" / "init", family="llava", seed=0, max_position_embeddings=64
    )
    sft(init, HERE / "model" / "warm_start", data, steps=int(sys.argv[1]) if len(sys.argv) > 1 else 300)


if __name__ == "__main__":
    main()
