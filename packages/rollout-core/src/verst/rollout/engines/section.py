"""`EngineSection`: the base of every engine's config model (its `type`, the model it serves, and
the three things each engine knows: `capabilities()`, `problems(key)`, `build(...)`). Light, and
imports no engine, so every engine folder's config (`vllm/config.py`, ...) and the `ENGINES` table
(`config`) can import it without a circle; `verst.rollout.engines.config.EngineSection` is the same class.
"""

from __future__ import annotations

from pydantic import Field

from verst.rollout.config import Section, path_field
from verst.rollout.engine import EngineCapabilities, InferenceEngine
from verst.rollout.errors import Problem


class EngineSection(Section):
    """Base of every engine's config: its `type` and the model it serves."""

    type: str = Field(
        "embedded",
        description=(
            "embedded (in-process HF model), sglang (existing servers), sglang_launch (start them), "
            "vllm (existing vLLM servers), vllm_launch (start them), or an import path 'pkg.module:Engine' (a class with a nested Config)."
        ),
    )
    model_path: str | None = path_field(
        description="Model directory (HF layout); None = the trainer's model."
    )

    def capabilities(self) -> EngineCapabilities:
        """What this engine can do (override: the defaults are the least an engine offers)."""
        return EngineCapabilities()

    def problems(self, key: str = "engine") -> list[Problem]:
        """This engine's own config problems, keyed under `key` (the model-path check is
        `engine_problems`'s, from `capabilities().needs_model_path`)."""
        return []

    async def build(self, *, max_concurrency: int) -> InferenceEngine:
        """Create the engine (the run's event loop is running); `max_concurrency` bounds requests."""
        raise NotImplementedError(f"{type(self).__name__}.build")

    def with_lora(self, *, max_rank: int, target_modules: list[str], adapters: int) -> EngineSection:
        """A copy set up to serve LoRA adapters up to `max_rank` on `target_modules`, `adapters`
        of them at once (engines that need launch flags for it override this)."""
        return self

    def with_model_path(self, path: str | None) -> EngineSection:
        """A copy whose `model_path` defaults to `path` (the trainer's or a teacher's model)."""
        if self.model_path is None and path is not None:
            return self.model_copy(update={"model_path": path})
        return self
