"""`verst export RUN_DIR [--merge] [--out DIR]`: the newest checkpoint of a run as something
Hugging Face loads.

A LoRA run's checkpoint holds the adapter only: without `--merge` the export is that PEFT
adapter directory (`PeftModel.from_pretrained(base, DIR)`, or SGLang's `--lora-paths`); with
`--merge` the adapter is folded into the base weights and the result is a plain model directory
(`AutoModelForCausalLM.from_pretrained(DIR)`) with the base model's tokenizer files. A full
fine-tuning run's checkpoint is already a model directory: it is copied (`--merge` changes
nothing).

`--out` never deletes what verst did not write: it must be a new or empty folder, or an earlier
export (marked by `MARKER`), which is replaced atomically (the new export is written aside and
swapped in only once complete).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
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


MARKER = ".verst-export.json"
"""Written into every export: what verst wrote (and may replace), and nothing else."""


def _is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _out_problems(out: Path, run_dir: Path, ckpt: Path) -> list[Problem]:
    """Why `out` may not receive an export: verst never deletes what it did not write."""
    fix = "pass --out a new or empty folder (or an earlier export of verst export, which is replaced)"
    if _is_within(run_dir, out):
        what = "is the run directory" if out == run_dir else f"holds the run directory {run_dir}"
        return [Problem("--out", f"{out} {what}; exporting there would delete the run", fix)]
    if _is_within(out, ckpt):
        return [Problem("--out", f"{out} is inside the checkpoint being exported ({ckpt})", fix)]
    if out.exists() and not out.is_dir():
        return [Problem("--out", f"{out} is a file, not a folder", fix)]
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        return [Problem("--out", f"{out} is not empty and is not an earlier export (no {MARKER})", fix)]
    return []


def _replace(out: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` into a fresh sibling folder, then swap it in: an earlier export (or an empty
    folder) at `out` is replaced only once the new one is complete, and is kept if writing fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write(tmp / "export")
        if out.exists():
            old = tmp / "old"
            os.rename(out, old)
        os.rename(tmp / "export", out)
    except BaseException:
        if (tmp / "old").exists() and not out.exists():
            os.rename(tmp / "old", out)  # put the earlier export back
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def export_run(run_dir: str | Path, out: str | Path | None = None, *, merge: bool = False) -> Path:
    """Write the newest checkpoint of `run_dir` to `out` (default `RUN_DIR/export/{adapter,merged,model}`).

    `out` must be new, empty, or an earlier export (it holds `MARKER`), which is replaced
    atomically; anything else — the run directory itself, a folder holding it (`.`), any
    non-empty folder verst did not write — is a `ConfigError`, and nothing is deleted.
    """
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
    out = Path(out).resolve() if out is not None else run_dir / "export" / kind
    problems = _out_problems(out, run_dir, ckpt)
    if problems:
        raise ConfigError(problems)
    base = _base_model(run_dir) if kind != "model" else None

    def write(dest: Path) -> None:
        _write(kind, ckpt, base, dest)
        (dest / MARKER).write_text(
            json.dumps({"run_dir": str(run_dir), "checkpoint": ckpt.name, "kind": kind})
        )

    _replace(out, write)
    return out


def _write(kind: str, ckpt: Path, base_model: tuple[str, str] | None, out: Path) -> None:
    """The export of `kind` (model, adapter, merged) of checkpoint `ckpt`, into the new folder `out`."""
    if kind == "model":
        shutil.copytree(ckpt / "model", out)
        return
    assert base_model is not None
    base, dtype = base_model
    adapter = ckpt / "adapter"
    if kind == "adapter":
        shutil.copytree(adapter, out)
        config = json.loads((out / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = base
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
        return
    import torch
    from transformers import AutoModelForCausalLM

    from verst.trainer.train.lora import require_peft

    peft = require_peft()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype))
    merged = peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged.save_pretrained(out)
    _copy_tokenizer(Path(base), out)
