"""`EngineSection`: the base of every engine's config model (its `type`, the model it serves, and
the three things each engine knows: `capabilities()`, `problems(key)`, `build(...)`). Light, and
imports no engine, so every engine folder's config (`vllm/config.py`, ...) and the `ENGINES` table
(`config`) can import it without a circle; `verst.rollout.engines.config.EngineSection` is the same class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from verst.rollout.config import Section, path_field
from verst.rollout.engine import EngineCapabilities, InferenceEngine
from verst.rollout.errors import Problem

if TYPE_CHECKING:
    from verst.rollout.engines.common.http import HttpOptions


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


class HttpEngineSection(EngineSection):
    """Base of the configs of engines reached over HTTP (SGLang, vLLM): the client's timeout and
    retries (`verst.rollout.engines.common.http.HttpSettings`)."""

    request_timeout_s: float = Field(
        600.0, gt=0, description="Bound of one generate call, retries included (then the run stops)."
    )
    control_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Bound of one control call (abort, pause/continue, weight version, worker list), "
        "retries included.",
    )
    refit_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Bound of one weight-sync call (each update, begin/end, reload; LoRA loads, memory "
        "release/resume), retries included.",
    )
    health_timeout_s: float = Field(5.0, gt=0, description="Bound of one health probe.")
    max_retries: int = Field(3, ge=0, description="Retries of a retryable failure (connection error, 5xx).")
    backoff_s: float = Field(0.5, ge=0, description="First retry delay, doubled each retry.")

    def http_options(self, share: int) -> HttpOptions:
        """A client's HTTP keyword arguments, with `share` pooled connections (its part of the
        rollout's concurrency)."""
        return {
            "max_connections": max(1, share),
            "timeout_s": self.request_timeout_s,
            "control_timeout_s": self.control_timeout_s,
            "refit_timeout_s": self.refit_timeout_s,
            "health_timeout_s": self.health_timeout_s,
            "max_retries": self.max_retries,
            "backoff_s": self.backoff_s,
        }
