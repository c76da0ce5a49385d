"""`engine.speculative`: the embedded engine's proposer, chosen by `type` (light: pydantic only).

    [engine.speculative]
    type = "ngram"          # "off" (default), "ngram" (prompt lookup), "draft_model", or "pkg.module:Class"
    num_tokens = 4
    gate = "auto"           # the cost gate: speculate only where it is expected to pay ("off": always)

Each variant is a config class with a `build(model, vocab)` that makes its proposer (the torch
parts are imported only then) and its own `problems(key)`; `SPECULATIVE` is the table.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from verst.rollout.config import Section, path_field
from verst.rollout.errors import Problem
from verst.rollout.variants import VariantTable


class SpeculativeSection(Section):
    """Base of every proposer's config."""

    type: str = Field("off", description="off, ngram (prompt lookup), draft_model, or 'pkg.module:Class'.")
    num_tokens: int = Field(4, ge=1, le=16, description="Most tokens proposed per row and step.")
    gate: Literal["auto", "off"] = Field(
        "auto",
        description=(
            "auto: speculate only when the expected tokens per unit time beat plain decoding (each "
            "row's acceptance EMA against the measured cost of a k+1-token verify forward); off: "
            "whenever a row has a proposal (docs/engines.md)."
        ),
    )
    verify_cost: float = Field(
        0.5,
        gt=0,
        description=(
            "The gate's model of a verify forward's extra cost per proposed token, relative to a "
            "plain step, until both are measured (seeded rows always use it: their choice must not "
            "depend on timings)."
        ),
    )

    @property
    def enabled(self) -> bool:
        return True

    def problems(self, key: str = "engine.speculative") -> list[Problem]:
        return []

    def build(self, model: Any, vocab: int) -> Any:
        """The proposer: `propose(batch, rows, caps) -> (tokens per row, q or None)`, `refit(named)`."""
        raise NotImplementedError(type(self).__name__)


class SpeculativeOff(SpeculativeSection):
    """Plain decoding: one token per forward (the default)."""

    type: Literal["off"] = Field("off", description="No speculative decoding.")

    @property
    def enabled(self) -> bool:
        return False


class NgramSpeculative(SpeculativeSection):
    """Prompt lookup: continue the latest earlier occurrence of the row's last n tokens."""

    type: Literal["ngram"] = Field("ngram", description="n-gram / prompt-lookup proposals (no model).")
    min_ngram: int = Field(2, ge=1, description="Shortest suffix that must match to propose.")
    max_ngram: int = Field(4, ge=1, description="Longest suffix matched (longer matches win).")

    def problems(self, key: str = "engine.speculative") -> list[Problem]:
        if self.max_ngram < self.min_ngram:
            return [Problem(f"{key}.max_ngram", f"{self.max_ngram} < min_ngram {self.min_ngram}", "raise max_ngram")]
        return []

    def build(self, model: Any, vocab: int) -> Any:
        from verst.rollout.engines.embedded.speculative.ngram import NgramProposer

        return NgramProposer(self.min_ngram, self.max_ngram)


class DraftModelSpeculative(SpeculativeSection):
    """A smaller checkpoint with the target's tokenizer proposes; the target verifies."""

    type: Literal["draft_model"] = Field("draft_model", description="Draft-model proposals.")
    model_path: str | None = path_field(description="The draft checkpoint (HF layout, the target's vocabulary).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="The draft's weight dtype.")
    context_window: int = Field(256, ge=1, description="Tokens of each row's context the draft reads per step.")
    refit: Literal["fixed", "with_policy"] = Field(
        "fixed",
        description=(
            "fixed: the draft stays as loaded; with_policy: each policy weight update also sets the "
            "draft's tensors of the same name and shape (a draft made of the policy's first layers)."
        ),
    )

    def problems(self, key: str = "engine.speculative") -> list[Problem]:
        if not self.model_path:
            return [Problem(f"{key}.model_path", "draft_model needs a draft checkpoint", f"set {key}.model_path")]
        return []

    def build(self, model: Any, vocab: int) -> Any:
        import torch

        from verst.rollout.engines.embedded.speculative.draft import DraftModelProposer
        from verst.rollout.multimodal.families import auto_model_class

        assert self.model_path is not None
        device = next(model.parameters()).device
        draft = auto_model_class(self.model_path).from_pretrained(self.model_path, dtype=getattr(torch, self.dtype))
        return DraftModelProposer(
            draft.to(device), context_window=self.context_window, refit=self.refit, vocab=vocab
        )


SPECULATIVE: VariantTable[SpeculativeSection] = VariantTable(
    "speculative proposer",
    SpeculativeSection,
    {"off": SpeculativeOff, "ngram": NgramSpeculative, "draft_model": DraftModelSpeculative},
    default="off",
)
"""The proposer table: built-in `type` → config model."""

SpeculativeConfig = SPECULATIVE.field
"""The annotation of `engine.speculative`."""


def parse_speculative(value: Any) -> SpeculativeSection:
    """A proposer config from a table, a name, a JSON string (`verst serve --speculative`) or None."""
    import json

    from pydantic import TypeAdapter

    if value is None:
        return SpeculativeOff()
    if isinstance(value, str) and value.lstrip().startswith("{"):
        value = json.loads(value)
    return TypeAdapter(SpeculativeConfig).validate_python(value)
