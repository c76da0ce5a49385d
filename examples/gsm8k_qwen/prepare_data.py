"""Write GSM8K as verst prompt JSONL (chat messages + the numeric answer as label).

Why: the GPU recipe (docs/gpu-recipe.md) trains Qwen2.5-0.5B-Instruct on GSM8K with the
built-in `math` reward, which compares the last number of the response with the label.

    # from a local copy of GSM8K (a folder with train/test files, .jsonl or .parquet, holding
    # the dataset's `question` and `answer` fields) — works without network access:
    uv run --group bench python examples/gsm8k_qwen/prepare_data.py --source /path/to/gsm8k/main
    # or from the Hugging Face Hub (needs network access to it):
    uv run --group bench python examples/gsm8k_qwen/prepare_data.py
    # → examples/gsm8k_qwen/data/{train,test}.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data"
INSTRUCTION = "Solve the problem step by step. Put the final answer after '####'."


def _local_rows(source: Path, split: str) -> list[dict]:
    files = sorted(source.glob(f"{split}*.jsonl")) + sorted(source.glob(f"{split}*.parquet"))
    if not files:
        raise SystemExit(
            f"no {split}*.jsonl or {split}*.parquet under {source}; give the GSM8K 'main' folder"
        )
    rows: list[dict] = []
    for f in files:
        if f.suffix == ".jsonl":
            rows += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        else:
            import pyarrow.parquet as pq

            rows += pq.read_table(f).to_pylist()
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="GSM8K -> verst prompt JSONL")
    p.add_argument("--source", type=Path, default=None, help="local GSM8K folder (default: the Hub)")
    args = p.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        if args.source is not None:
            rows = _local_rows(args.source, split)
        else:
            from datasets import load_dataset

            rows = load_dataset("openai/gsm8k", "main", split=split)
        with open(OUT / f"{split}.jsonl", "w") as f:
            for row in rows:
                answer = row["answer"].split("####")[-1].strip().replace(",", "")
                prompt = [{"role": "user", "content": f"{row['question']}\n\n{INSTRUCTION}"}]
                f.write(json.dumps({"prompt": prompt, "label": answer}) + "\n")
        print(f"{split}: {len(rows)} rows → {OUT / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()
