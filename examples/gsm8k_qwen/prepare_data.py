"""Write GSM8K as verst prompt JSONL (chat messages + the numeric answer as label).

Why: the GPU recipe (docs/gpu-recipe.md) trains Qwen2.5-0.5B-Instruct on GSM8K with the
built-in `math` reward, which compares the last number of the response with the label.
Needs network access and the `datasets` package (`uv sync --group bench` has it).

    uv run --group bench python examples/gsm8k_qwen/prepare_data.py   # → examples/gsm8k_qwen/data/
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data"
INSTRUCTION = "Solve the problem step by step. Put the final answer after '####'."


def main() -> None:
    from datasets import load_dataset

    OUT.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        rows = load_dataset("openai/gsm8k", "main", split=split)
        with open(OUT / f"{split}.jsonl", "w") as f:
            for row in rows:
                answer = row["answer"].split("####")[-1].strip().replace(",", "")
                prompt = [{"role": "user", "content": f"{row['question']}\n\n{INSTRUCTION}"}]
                f.write(json.dumps({"prompt": prompt, "label": answer}) + "\n")
        print(f"{split}: {len(rows)} rows → {OUT / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()
