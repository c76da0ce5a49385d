"""`verst export RUN_DIR [--merge] [--out DIR]`: the newest checkpoint of a run as something
Hugging Face loads.

A LoRA run's checkpoint holds the adapter only: without `--merge` the export is that PEFT
adapter directory (`PeftModel.from_pretrained(base, DIR)`, or SGLang's `--lora-paths`); with
`--merge` the adapter is folded into the base weights and the result is a plain model directory
(`AutoModelForCausalLM.from_pretrained(DIR)`) with the base model's tokenizer files. A full
fine-tuning run's checkpoint is already a model directory: it is copied (`--merge` changes
nothing).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from verst.rollout.errors import ConfigError, Problem


def _copy_tokenizer(source: Path, out: Path) -> None:
    for name in source.iterdir() if source.is_dir() else ():
        wanted = "token" in name.name or name.name in ("generation_config.json", "chat_template.jinja")
        if name.is_file() and wanted and not (out / name.name).exists():
            shutil.copy2(name, out / name.name)


def _base_model(run_dir: Path) -> tuple[str, str]:
    """(base model path, dtype) the run trained from, per its `config.resolved.json`."""
    resolved = run_dir / "config.resolved.json"
    if not resolved.is_file():
        raise ConfigError(
            [Problem(str(resolved), "missing", "export needs the run directory `verst train` wrote")]
        )
    cfg = json.loads(resolved.read_text())
    base = cfg["train"].get("model_path") or cfg["engine"].get("model_path")
    return str(base), str(cfg["train"].get("dtype", "float32"))


def export_run(run_dir: str | Path, out: str | Path | None = None, *, merge: bool = False) -> Path:
    """Write the newest checkpoint of `run_dir` to `out` (default `RUN_DIR/export/{adapter,merged,model}`)."""
    from verst.trainer.run.checkpoint import latest_checkpoint

    run_dir = Path(run_dir).resolve()
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        raise ConfigError(
            [
                Problem(
                    "RUN_DIR",
                    f"{run_dir} has no complete checkpoint",
                    "pass a run directory of `verst train`",
                )
            ]
        )
    adapter = ckpt / "adapter"
    kind = "model" if not adapter.is_dir() else ("merged" if merge else "adapter")
    out = Path(out) if out is not None else run_dir / "export" / kind
    if out.exists():
        shutil.rmtree(out)
    if kind == "model":
        shutil.copytree(ckpt / "model", out)
        return out
    base, dtype = _base_model(run_dir)
    if kind == "adapter":
        shutil.copytree(adapter, out)
        config = json.loads((out / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = base
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
        return out
    import torch
    from transformers import AutoModelForCausalLM

    from verst.trainer.train.lora import require_peft

    peft = require_peft()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype))
    merged = peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged.save_pretrained(out)
    _copy_tokenizer(Path(base), out)
    return out
