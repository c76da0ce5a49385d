"""`ColocatedMemory`: when a colocated engine gives its GPU memory to the trainer, and takes it back.

SGLang 0.5.23's rules (`release_memory_occupation` / `resume_memory_occupation`): releasing with
no tags releases the weights too; the weights come back on resume only with
`--enable-weights-cpu-backup`; release asserts the server is idle (pause with `retract` first).
So the plan around one training step is:

    rollout → pause + release everything (a refit follows, so the weights need no backup)
            → train
    refit   → resume `weights` (still paused) → load the new weights
            → resume `kv_cache`, `cuda_graph` → continue generation
    eval    → nothing is released: the next rollout runs on the same weights

Eval at step 0 and eval after a refit therefore run on live weights, and a rollout never runs
on released memory: `before_generate` resumes anything still released (with a clear error if
the weights were released and no refit has loaded new ones — they would be garbage).
Engines without the hooks (or a non-colocated run) make every method a no-op.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from verst.rollout.engine import MemoryReleasable

WEIGHTS = ["weights"]
"""What a refit restores."""
CACHES = ["kv_cache", "cuda_graph"]
"""What no refit restores: taken back after the weights are loaded."""


class ColocatedMemoryError(RuntimeError):
    """Generation was asked for while the weights were released and never reloaded."""


class ColocatedMemory:
    """Releases and resumes a colocated engine's memory in SGLang's order (see module docstring)."""

    def __init__(
        self, engine: Any, run: Callable[[Coroutine[Any, Any, Any]], Any], *, colocated: bool
    ) -> None:
        """`run` runs a coroutine on the engine's loop and returns its result."""
        self.engine = engine
        self.run = run
        self.enabled = colocated and isinstance(engine, MemoryReleasable)
        """False: every method is a no-op (not colocated, or the engine cannot release)."""
        self.released: list[str] = []
        """Tags released and not yet resumed."""
        self.weights_pending = False
        """The weights were released; only a refit brings valid ones back."""

    def after_rollout(self) -> None:
        """Free everything for the train step that follows (a refit will reload the weights)."""
        if not self.enabled or self.released:
            return
        self.run(self.engine.release_memory_occupation(None))
        self.released = WEIGHTS + CACHES
        self.weights_pending = True

    def before_refit(self) -> None:
        """Take back the weights' memory only (generation stays paused) so the refit can fill it."""
        if self.enabled and "weights" in self.released:
            self.run(self.engine.resume_memory_occupation(WEIGHTS, continue_generation=False))
            self.released = [t for t in self.released if t != "weights"]

    def after_refit(self) -> None:
        """The new weights are in: take back the caches and continue generation."""
        self.weights_pending = False
        self._resume_rest()

    def before_generate(self) -> None:
        """Before a rollout or an eval: nothing may still be released."""
        if not self.enabled or not self.released:
            return
        if self.weights_pending:
            raise ColocatedMemoryError(
                "the engine's weights were released after the last rollout and no refit has loaded "
                "new ones; refit (push the weights) before generating again"
            )
        self._resume_rest()

    def _resume_rest(self) -> None:
        if self.enabled and self.released:
            self.run(self.engine.resume_memory_occupation(list(self.released)))
            self.released = []
