"""The run directory: one folder per run holding everything needed to inspect or resume it.

Layout (`RunDir` names each path)::

    runs/<name>/
      config.toml          the resolved config (file + overrides + defaults), as TOML
      metrics.jsonl        one JSON object per logged step: {"step": n, "time": t, <metric>: value...}
      lifecycle.jsonl      rollout lifecycle events (attempt_start/gen_start/gen_end/attempt_end)
      samples.jsonl        bounded per-sample previews and outcomes (verst.trainer.run.recording)
      status.json          state, phase, step, phase times, ETA (verst.trainer.run.recording)
      tensorboard/         TensorBoard event files (`tensorboard --logdir runs/<name>/tensorboard`)
      checkpoints/         step_<n>/ checkpoints written by the trainer (atomic rename)
      curves.png           reward, eval reward, response length, KL, entropy, clip fraction and
                           train/rollout log-prob mismatch over steps (written at the end)
      summary.json         the run's final summary (written at the end)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import date, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel


@dataclass(frozen=True, slots=True)
class RunDir:
    """Paths of one run directory."""

    root: Path
    """The run directory itself."""

    @property
    def config(self) -> Path:
        """The resolved config (TOML)."""
        return self.root / "config.toml"

    @property
    def metrics(self) -> Path:
        """Metrics, one JSON line per logged step."""
        return self.root / "metrics.jsonl"

    @property
    def events(self) -> Path:
        """Rollout lifecycle events (JSON lines)."""
        return self.root / "lifecycle.jsonl"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard event files."""
        return self.root / "tensorboard"

    @property
    def checkpoints(self) -> Path:
        """Checkpoints written by the trainer."""
        return self.root / "checkpoints"

    @property
    def curves(self) -> Path:
        """The training curves image written at the end."""
        return self.root / "curves.png"

    @property
    def summary(self) -> Path:
        """The final summary (JSON)."""
        return self.root / "summary.json"

    def create(self) -> RunDir:
        """Make the directory (and its sub-folders); returns self."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.tensorboard.mkdir(exist_ok=True)
        self.checkpoints.mkdir(exist_ok=True)
        return self

    def write_config(self, config: BaseModel | dict[str, Any], header: str = "") -> Path:
        """Write the resolved config as TOML (None values are omitted: TOML has no null)."""
        data = config.model_dump(mode="json") if isinstance(config, BaseModel) else config
        text = (header.rstrip() + "\n\n" if header else "") + to_toml(data)
        self.config.write_text(text, encoding="utf-8")
        return self.config

    def write_summary(self, summary: dict[str, Any]) -> Path:
        """Write the final summary as JSON."""
        self.summary.write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
        return self.summary


# ---------------------------------------------------------------- a small TOML writer


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_scalar(v) for v in value if v is not None) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{_key(k)} = {_scalar(v)}" for k, v in value.items() if v is not None)
        return "{ " + items + " }" if items else "{}"
    return _string(str(value))


def _string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _key(key: str) -> str:
    bare = key and all(c.isascii() and (c.isalnum() or c in "-_") for c in key)
    return key if bare else _string(key)


def to_toml(data: dict[str, Any], _prefix: tuple[str, ...] = ()) -> str:
    """Serialise nested dicts of scalars/lists to TOML (nested dicts become tables; None is omitted)."""
    scalars = [(k, v) for k, v in data.items() if v is not None and not (isinstance(v, dict) and v)]
    tables = [(k, v) for k, v in data.items() if isinstance(v, dict) and v]
    lines: list[str] = []
    if _prefix and (scalars or not tables):
        lines.append("[" + ".".join(map(_key, _prefix)) + "]")
    lines += [f"{_key(k)} = {_scalar(v)}" for k, v in scalars]
    for key, table in tables:
        if lines:
            lines.append("")
        lines.append(to_toml(table, (*_prefix, key)).rstrip("\n"))
    return "\n".join(lines) + "\n"
