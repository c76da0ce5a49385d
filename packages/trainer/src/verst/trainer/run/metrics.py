"""`RunLogger`: the trainer's `MetricsLogger`, fanning each step's metrics out to every sink.

Sinks: `metrics.jsonl` in the run directory (always), TensorBoard event files (always; the
`tensorboard` package is a trainer dependency), Weights & Biases (only when the `wandb` package
is installed *and* enabled — `WANDB_PROJECT` set in the effective environment, and `WANDB_MODE`
not `disabled` — imported lazily), and the live progress display. At `close()` it draws
`curves.png` from `metrics.jsonl`.

The controller calls `log(step, metrics)` after each step (and after each eval), `phase(name)`
when it enters rollout / train / sync / eval / checkpoint, and `close()` once at the end.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

from verst.rollout.errors import MissingOptionalDependency
from verst.trainer.run.curves import plot_curves
from verst.trainer.run.progress import ProgressDisplay
from verst.trainer.run.run_dir import RunDir

logger = logging.getLogger(__name__)


def wandb_enabled(env: Mapping[str, str]) -> bool:
    """W&B logging is asked for: `WANDB_PROJECT` is set and `WANDB_MODE` is not `disabled`."""
    return bool(env.get("WANDB_PROJECT")) and env.get("WANDB_MODE", "").lower() != "disabled"


def _numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool | int | float):
            out[key] = float(value)
        elif hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:
            out[key] = float(value.item())
    return out


class RunLogger:
    """Writes metrics to the run directory, TensorBoard, W&B (optional) and the progress display."""

    def __init__(
        self,
        run_dir: RunDir,
        *,
        total_steps: int,
        env: Mapping[str, str] | None = None,
        run_name: str = "run",
        config: Mapping[str, Any] | None = None,
        progress: ProgressDisplay | None = None,
        tensorboard: bool = True,
        curves: bool = True,
    ) -> None:
        env = dict(env or {})
        self.run_dir = run_dir.create()
        self.progress = progress if progress is not None else ProgressDisplay(total_steps)
        self._metrics_file = open(run_dir.metrics, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self._curves = curves
        self._closed = False
        self._phase_started: dict[str, float] = {}
        self.phase_seconds: dict[str, float] = {}
        """Total wall seconds spent in each phase (rollout, train, sync, eval, ...)."""
        self._current_phase: str | None = None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir.tensorboard))
        self._wandb = None
        if wandb_enabled(env):
            try:
                import wandb
            except ModuleNotFoundError as exc:
                if exc.name != "wandb":
                    raise
                raise MissingOptionalDependency(
                    "WANDB_PROJECT is set but the wandb package is not installed; install it with "
                    "`uv sync --extra wandb` (or `pip install verst[wandb]`), or unset WANDB_PROJECT"
                ) from None
            self._wandb = wandb.init(
                project=env["WANDB_PROJECT"],
                entity=env.get("WANDB_ENTITY") or None,
                name=run_name,
                dir=str(run_dir.root),
                config=dict(config or {}),
                mode=env.get("WANDB_MODE") or None,
            )

    # ---- MetricsLogger protocol

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record one step's metrics everywhere."""
        values = _numeric(metrics)
        row = {
            "step": int(step),
            "time": time.time(),
            **{k: v if math.isfinite(v) else None for k, v in values.items()},
        }
        self._metrics_file.write(json.dumps(row) + "\n")
        self._metrics_file.flush()
        if self._tb is not None:
            for key, value in values.items():
                if math.isfinite(value):
                    self._tb.add_scalar(key, value, global_step=int(step))
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=int(step))
        self.progress.log(step, values)

    def phase(self, name: str) -> None:
        """The run entered a phase; timed, and shown on the progress display."""
        now = time.monotonic()
        if self._current_phase is not None:
            started = self._phase_started.pop(self._current_phase, now)
            self.phase_seconds[self._current_phase] = (
                self.phase_seconds.get(self._current_phase, 0.0) + now - started
            )
        self._current_phase = name
        self._phase_started[name] = now
        self.progress.phase(name)

    def message(self, text: str) -> None:
        """Print a line of text without breaking the live progress line."""
        self.progress.message(text)

    def close(self) -> None:
        """Flush and close every sink, then draw `curves.png` (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.phase("done")
        self.progress.close()
        self._metrics_file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._curves:
            try:
                plot_curves(self.run_dir.metrics, self.run_dir.curves, title=self.run_dir.root.name)
            except Exception:  # a plotting failure must not lose a finished run
                logger.exception("could not draw %s", self.run_dir.curves)

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
