"""reasoning-gym's procedural tasks as a verst data source, and its `score_answer` as the reward.

    [rollout.data]
    source = "reasoning_gym"
    [rollout.data.options]
    dataset = "spell_backward"                 # any name reasoning_gym.create_dataset knows
    config = { min_word_len = 3, max_word_len = 6 }   # that dataset's own config fields
    seed = 0
    prompt_template = "{question}\\n"           # how a question becomes the prompt

    [rollout.reward]
    type = "reasoning_gym"                     # the dataset's own score_answer

Item `i` of the stream is the dataset's item `i` for `seed` (reasoning-gym seeds each item with
`seed + i`), generated in chunks of `chunk_size`; the stream is infinite for training (`size`
None) and finite for eval sets (`size` set). The position is one integer plus the handed-back
groups, so `state_dict()` resumes exactly. Each sample's `label` is the full reasoning-gym entry
(`question`, `answer`, `metadata`), which is what `score_answer(answer, entry)` needs. Needs the
`reasoning-gym` extra (`uv sync --extra reasoning-gym`).
"""

from __future__ import annotations

import functools
from collections import deque
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from verst.rollout.data_sources import GeneratedSource
from verst.rollout.engines.common.errors import require
from verst.rollout.errors import DataError, Problem
from verst.rollout.sample import Sample, Status

EXTRA = "reasoning-gym"
FEATURE = "the reasoning_gym data source"
STATE_VERSION = 1


def _rg() -> Any:
    return require("reasoning_gym", extra=EXTRA, feature=FEATURE)


class ReasoningGymSource(GeneratedSource):
    """A seeded, resumable (and, without `size`, infinite) stream of reasoning-gym tasks."""

    class Config(BaseModel):
        """`rollout.data.options` of `source = "reasoning_gym"`."""

        model_config = ConfigDict(extra="forbid")

        dataset: str = Field(description="reasoning-gym dataset name, e.g. 'spell_backward', 'chain_sum'.")
        config: dict[str, Any] = Field(
            default_factory=dict,
            description="The dataset's own config fields (its dataclass), except seed/size.",
        )
        seed: int = Field(0, description="Item i is generated from seed + i.")
        size: int | None = Field(
            None, ge=1, description="Number of items (None = infinite; eval sets need a size)."
        )
        prompt_template: str = Field(
            "{question}", description="The prompt; {question} is the task's question."
        )
        chunk_size: int = Field(1000, ge=1, description="Items generated per reasoning-gym dataset object.")

    @staticmethod
    def problems(options: Config, key: str) -> list[Problem]:
        """Deeper checks than the schema: the dataset exists and accepts `config`."""
        return options_problems(options, key)

    options: Config

    def _start(self) -> None:
        self.index = 0
        """Items handed out so far (the next item's index)."""
        self._buffer: deque[list[Sample]] = deque()
        self._chunk: tuple[int, Any] | None = None
        problems = options_problems(self.options, "rollout.data.options")
        if problems:
            raise DataError("; ".join(f"{p.key}: {p.why} (fix: {p.fix})" for p in problems))

    def _dataset(self, chunk: int) -> Any:
        if self._chunk is None or self._chunk[0] != chunk:
            o = self.options
            ds = _rg().create_dataset(
                o.dataset, **o.config, seed=o.seed + chunk * o.chunk_size, size=o.chunk_size
            )
            self._chunk = (chunk, ds)
        return self._chunk[1]

    def item(self, index: int) -> dict[str, Any]:
        """The reasoning-gym entry at `index` (deterministic for the options)."""
        chunk, offset = divmod(index, self.options.chunk_size)
        return self._dataset(chunk)[offset]

    def sample(self, index: int) -> Sample:
        """Item `index` as a PENDING prompt sample (label = the entry)."""
        entry = self.item(index)
        prompt: Any = self.options.prompt_template.format(question=entry["question"])
        if self.apply_chat_template and self.tokenizer is not None:
            prompt = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        meta = {"reasoning_gym": {"dataset": self.options.dataset, "index": index}}
        return Sample(prompt=prompt, label=_plain(entry), metadata=meta, status=Status.PENDING)

    def __len__(self) -> int:
        """Items in a finite source (an infinite one raises TypeError, as `len()` of a generator)."""
        if self.options.size is None:
            raise TypeError("an infinite reasoning_gym source has no length")
        return self.options.size

    def samples(self) -> list[Sample]:
        """Every item of a finite source (an eval set)."""
        return [self.sample(i) for i in range(len(self))]

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        """`num_groups` groups: handed-back groups first, then the next items (wrapping a finite source)."""
        groups: list[list[Sample]] = []
        while self._buffer and len(groups) < num_groups:
            groups.append(self._buffer.popleft())
        while len(groups) < num_groups:
            index = self.index if self.options.size is None else self.index % self.options.size
            prompt = self.sample(index)
            self.index += 1
            groups.append([prompt.clone() for _ in range(self.n_samples_per_prompt)])
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Take back unused groups; they are served first."""
        self._buffer.extend(list(g) for g in groups)

    def state_dict(self) -> dict[str, Any]:
        """The position, the options it is valid for, and the handed-back groups."""
        return {
            "version": STATE_VERSION,
            "index": self.index,
            "dataset": self.options.dataset,
            "seed": self.options.seed,
            "buffer": [[s.to_dict() for s in g] for g in self._buffer],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict`; refuses a state saved for another dataset or seed."""
        for key in ("dataset", "seed"):
            if state.get(key) != getattr(self.options, key):
                raise DataError(
                    f"the saved reasoning_gym state is for {key}={state.get(key)!r}, this run has "
                    f"{getattr(self.options, key)!r}; fix: resume with the saved run's rollout.data.options"
                )
        self.index = int(state["index"])
        self._buffer = deque([Sample.from_dict(d) for d in g] for g in state.get("buffer", []))


def _plain(value: Any) -> Any:
    """JSON-friendly copy of an entry (tuples → lists), so it survives checkpoints unchanged."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def options_problems(options: ReasoningGymSource.Config, key: str) -> list[Problem]:
    """The dataset name is registered and its config fields are valid (imports reasoning_gym)."""
    from dataclasses import fields

    _rg()
    from reasoning_gym.factory import DATASETS as registry

    if options.dataset not in registry:
        names = sorted(registry)
        return [
            Problem(
                f"{key}.dataset",
                f"unknown reasoning-gym dataset {options.dataset!r}",
                f"use one of {names[:40]}{' ...' if len(names) > 40 else ''}",
            )
        ]
    config_cls = registry[options.dataset][1]
    valid = {f.name for f in fields(config_cls)} - {"seed", "size"}
    bad = sorted(set(options.config) - valid)
    if bad:
        return [
            Problem(
                f"{key}.config",
                f"{options.dataset!r} has no config field(s) {bad}",
                f"valid fields: {sorted(valid)}",
            )
        ]
    try:
        cfg = config_cls(**options.config, seed=options.seed, size=options.chunk_size)
        if hasattr(cfg, "validate"):
            cfg.validate()
    except (AssertionError, TypeError, ValueError) as exc:
        return [
            Problem(
                f"{key}.config",
                f"{options.dataset!r} rejects its config: {exc or type(exc).__name__}",
                "fix the values (see the dataset's config class in reasoning_gym)",
            )
        ]
    return []


def score_answer(response: str, label: Any) -> float:
    """The reward rule `reasoning_gym`: the entry's dataset scores the response (label = entry)."""
    if not (isinstance(label, dict) and isinstance(label.get("metadata"), dict)):
        raise ValueError("the label is not a reasoning-gym entry; use rollout.data.source = 'reasoning_gym'")
    name = label["metadata"].get("source_dataset")
    if not isinstance(name, str):
        raise ValueError("the reasoning-gym entry has no metadata.source_dataset")
    return float(_scorer(name)(answer=response, entry=label))


@functools.cache
def _scorer(name: str) -> Any:
    """The dataset's `score_answer` (building a dataset object reads its data files: once per name)."""
    return _rg().get_score_answer_fn(name)
