"""OPD teachers: one config model per kind of teacher, chosen by `type`.

type = "engine"              scored by an inference engine after each rollout (rollout side)
type = "trainer"             loaded in the trainer and run on the batch (train side)
type = "pkg.module:Teacher"  your own teacher: a class whose nested `Config` subclasses `TeacherSection`

Each config owns its fields and knows `capabilities()` (where its log-probs are computed and what
it supports — the `[opd]` checks and both sides ask this instead of comparing type names),
`problems(key)` (its own config checks) and how it is built on the side that runs it:
`build_engine(...)` on the rollout side (an engine that scores a sample in one `max_new_tokens =
0` request), `build_model(...)` on the train side (a frozen `PolicyLogprobs`). The two sides are
different processes in a Ray run, so a teacher is built where it runs, not once for both.
`TEACHERS` is the table; adding a built-in kind is a config class here plus one entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from verst.rollout.config import Section, path_field
from verst.rollout.engines.config import ENGINES, EngineConfig, EngineSection
from verst.rollout.errors import Problem
from verst.rollout.variants import VariantTable

if TYPE_CHECKING:
    from verst.rollout.engine import InferenceEngine
    from verst.trainer.train.logprobs import PolicyLogprobs

TeacherLoader = Callable[[str, str], "PolicyLogprobs"]
"""`load(model_path, dtype)`: a frozen `PolicyLogprobs` of a Hugging Face directory, loaded the way
the trainer loads its reference model (the train side passes it to `build_model`)."""


@dataclass(frozen=True, slots=True)
class TeacherCapabilities:
    """Where a teacher's log-probs are computed and what that allows."""

    scored_in_rollout: bool = True
    """True: the rollout side scores each sample with `build_engine()`'s engine after the
    strategy returns; False: the train side runs `build_model()`'s model on the batch."""
    with_fsdp: bool = True
    """It works when the trainer shards (`train.fsdp`)."""

    @property
    def scores_student_ids(self) -> bool:
        """It can score the student's top-k ids at every position (the student-side token sets
        need this): only a teacher run in the trainer, which knows them, can."""
        return not self.scored_in_rollout


class TeacherSection(Section):
    """Base of every teacher's config: its `type` and its model."""

    type: str = Field(
        "engine",
        description=(
            "engine (scored by an inference engine after each rollout), trainer (loaded in the "
            "trainer process; every token set), or an import path 'pkg.module:Teacher' (a class "
            "with a nested Config)."
        ),
    )
    model_path: str | None = path_field(description="Hugging Face directory of the teacher.")

    def capabilities(self) -> TeacherCapabilities:
        """Where this teacher runs (override: the default is a rollout-side teacher)."""
        return TeacherCapabilities()

    def problems(self, key: str) -> list[Problem]:
        """This teacher's own config problems, keyed under `key` (`opd.teachers.NAME`)."""
        return []

    def model_dir(self) -> str | None:
        """The teacher's local model directory when known (for the vocabulary check)."""
        return self.model_path

    def local_model_paths(self, key: str) -> list[tuple[str, str | None]]:
        """(key, value) of the model directories this machine loads for the teacher (validation
        checks each exists); override for a teacher whose model is loaded elsewhere."""
        return [(f"{key}.model_path", self.model_path)]

    async def build_engine(self, *, max_concurrency: int) -> InferenceEngine:
        """Rollout-side teachers: the engine that scores this teacher's samples."""
        raise NotImplementedError(f"{type(self).__name__}.build_engine (a rollout-side teacher)")

    def build_model(self, load: TeacherLoader) -> PolicyLogprobs:
        """Train-side teachers: the frozen model run on the batch (`load` is the trainer's loader)."""
        raise NotImplementedError(f"{type(self).__name__}.build_model (a train-side teacher)")


class EngineTeacherConfig(TeacherSection):
    """A teacher scored by an inference engine after each rollout (embedded, SGLang, `verst serve`)."""

    type: Literal["engine"] = Field("engine", description="Scored by an inference engine.")
    model_path: str | None = path_field(
        description="Hugging Face directory of the teacher: the embedded engine's model when engine.model_path is unset."
    )
    engine: EngineConfig = Field(
        default_factory=ENGINES.build_default,
        description=(
            "The teacher's engine, an [engine]-like table (type='sglang' with urls for a served "
            "teacher; type='embedded' runs it in this process)."
        ),
    )

    def resolved_engine(self) -> EngineSection:
        """The engine config with `model_path` filled in from the teacher's."""
        return self.engine.with_model_path(self.model_path)

    def model_dir(self) -> str | None:
        """An engine that loads no model itself (SGLang servers) leaves it to `model_path`."""
        if not self.engine.capabilities().needs_model_path:
            return self.model_path
        return self.resolved_engine().model_path

    def local_model_paths(self, key: str) -> list[tuple[str, str | None]]:
        """Only an engine that loads its model here (not a server) reads the model paths."""
        if not self.engine.capabilities().needs_model_path:
            return []
        return [(f"{key}.model_path", self.model_path), (f"{key}.engine.model_path", self.engine.model_path)]

    def problems(self, key: str) -> list[Problem]:
        e = self.resolved_engine()
        out = []
        if e.capabilities().needs_model_path and not e.model_path:
            out.append(
                Problem(
                    f"{key}.model_path",
                    f"an engine teacher of engine.type = {e.type!r} needs a model",
                    f"set {key}.model_path (or {key}.engine.model_path)",
                )
            )
        return out + e.problems(f"{key}.engine")

    async def build_engine(self, *, max_concurrency: int) -> InferenceEngine:
        from verst.rollout.engines.config import build_engine

        return await build_engine(self.resolved_engine(), max_concurrency=max_concurrency)


class TrainerTeacherConfig(TeacherSection):
    """A teacher loaded (frozen) in the trainer and run on the batch: every token set, no server."""

    type: Literal["trainer"] = Field("trainer", description="Loaded in the trainer process.")
    model_path: str | None = path_field(description="Hugging Face directory of the teacher (required).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype of the teacher model."
    )

    def capabilities(self) -> TeacherCapabilities:
        return TeacherCapabilities(scored_in_rollout=False, with_fsdp=False)

    def problems(self, key: str) -> list[Problem]:
        if self.model_path:
            return []
        return [
            Problem(f"{key}.model_path", "a trainer teacher needs a model", "set it to a HF model directory")
        ]

    def build_model(self, load: TeacherLoader) -> PolicyLogprobs:
        assert self.model_path is not None
        return load(self.model_path, self.dtype)


TEACHERS: VariantTable[TeacherSection] = VariantTable(
    "teacher",
    TeacherSection,
    {"engine": EngineTeacherConfig, "trainer": TrainerTeacherConfig},
    default="engine",
)
"""The teacher table: built-in `type` → config model (import paths are resolved by the table)."""

TeacherConfig = TEACHERS.field
"""The annotation of one `[opd.teachers.NAME]` table: the config model its `type` selects."""


def parse_teacher_config(data: dict[str, Any] | None = None, **fields: Any) -> TeacherSection:
    """A teacher config from a table (`{"type": "trainer", "model_path": ...}`) or keyword
    fields; raises pydantic's `ValidationError` like a section would."""
    from pydantic import TypeAdapter

    return TypeAdapter(TeacherConfig).validate_python({**(data or {}), **fields})
