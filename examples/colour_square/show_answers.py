"""Print the greedy answers of two checkpoints on the first held-out images, and save a strip
of those images (upscaled) for the README.

    uv run python examples/colour_square/show_answers.py runs/colour_square/checkpoints/step_60/model
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


async def answers(model: str, rows: list[dict]) -> list[str]:
    from verst.rollout.engine import GenerateRequest, SamplingParams
    from verst.rollout.engines.embedded import EmbeddedEngine

    engine = EmbeddedEngine.from_pretrained(model)
    try:
        out = []
        for row in rows:
            ids = engine.tokenizer(row["prompt"])["input_ids"]
            image = engine.vision.resolve(str(HERE / "data" / row["images"][0]), what="eval")
            ex = engine.vision.expand(ids, [image])
            sampling = SamplingParams(temperature=0.0, max_new_tokens=8)
            res = await engine.generate(GenerateRequest(ex.input_ids, sampling, images=tuple(ex.images)))
            out.append(engine.tokenizer.decode(res.output_ids, skip_special_tokens=True))
        return out
    finally:
        await engine.close()


def main() -> None:
    from PIL import Image

    after = sys.argv[1]
    rows = [json.loads(line) for line in (HERE / "data" / "eval.jsonl").read_text().splitlines()[:6]]
    before = asyncio.run(answers(str(HERE / "model" / "warm_start"), rows))
    trained = asyncio.run(answers(after, rows))
    strip = Image.new("RGB", (6 * 112 + 5 * 8, 112), (255, 255, 255))
    print("| image | label | warm start | after GRPO |\n|---|---|---|---|")
    for k, (row, b, a) in enumerate(zip(rows, before, trained, strict=True)):
        img = Image.open(HERE / "data" / row["images"][0]).resize((112, 112), Image.NEAREST)
        strip.paste(img, (k * 120, 0))
        print(f"| {k + 1} | {row['label']} | {b} | {a} |")
    out = HERE.parents[1] / "docs" / "images" / "colour_square_examples.png"
    strip.save(out)
    print(f"saved {out}")


if __name__ == "__main__":
    main()
