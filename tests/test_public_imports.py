"""Public import paths keep working.

Two lists. `DOCUMENTED_BEFORE_LAYOUT` is every `verst` name that docs/custom-functions.md,
agentic.md, environments.md, engines.md, lora.md and README.md named before the folder layout
changed (grepped from the docs at that commit: `from verst... import ...` lines and dotted
`verst.…` references); users' code may import them, so each still imports from that path (old
engine paths through thin re-export modules). The second list is read from today's docs: every
`from verst… import …`, dotted `verst.…` reference and `verst.…:Class` import path in docs/*.md,
README.md and examples/ must resolve, so a doc cannot name a path that does not exist.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

DOCUMENTED_BEFORE_LAYOUT: list[tuple[str, list[str]]] = [
    (
        "verst.rollout.agentic",
        ["ModelTurn", "Observation", "StepResult", "Environment", "append_turn", "tool_span"],
    ),
    ("verst.rollout.agentic.episode", ["AgenticGenerate"]),
    ("verst.rollout.agentic.tools", ["tool_schema", "ToolEnvironment", "ToolEnvironmentConfig"]),
    ("verst.rollout.agentic.config", ["EnvConfig"]),
    ("verst.rollout.config", ["RolloutConfig"]),
    ("verst.rollout.engine", ["EngineCapabilities", "InferenceEngine", "GenerateRequest"]),
    ("verst.rollout.engines.config", ["EngineSection", "ENGINES", "build_engine"]),
    ("verst.rollout.engines.embedded", ["EmbeddedEngine"]),
    ("verst.rollout.engines.sglang_client", ["SGLangClient"]),
    ("verst.rollout.engines.inprocess_openai", ["InProcessOpenAI"]),
    ("verst.rollout.engines.pool", ["EnginePool"]),
    ("verst.rollout.engines.server", ["main"]),
    ("verst.rollout.generate", ["STATUS_BY_FINISH_REASON", "prompt_token_ids", "request_prefix"]),
    ("verst.rollout.generate", ["generate_and_rm_group", "generate_and_rm", "offpolicy_loss_mask"]),
    ("verst.rollout.lifecycle", ["ListSink"]),
    ("verst.rollout.protocols", ["Capability", "GenerateState", "RolloutResult", "GenerateInput"]),
    ("verst.rollout.protocols", ["RolloutContext", "RolloutRequest", "RolloutStrategy"]),
    ("verst.rollout.sample", ["Sample", "Status"]),
    ("verst.rollout.sampling", ["sampling_params_for"]),
    ("verst.rollout.strategies.filters", ["FilterOutcome"]),
    ("verst.rollout.strategies.inference", ["InferenceRollout"]),
    ("verst.rollout.strategies.fully_async", ["FullyAsyncRollout"]),
    ("verst.rollout.toy", ["make_tiny_checkpoint", "CHARS", "build_char_tokenizer", "build_tiny_llama"]),
    ("verst.rollout.adapters", ["check_returned_sample"]),
    ("verst.rollout.logging_utils", ["sample_text_preview"]),
    ("verst.rollout.v1_args", ["build_v1_args"]),
    ("verst.rollout.errors", ["ConfigError", "MissingOptionalDependency"]),
    ("verst.rollout.rewards.rules", ["strip_trailing_stop"]),
    ("verst.trainer.algorithms", ["AlgorithmConfig", "LossNorm", "build_algorithm"]),
    ("verst.rollout_legacy", ["generate_rollout"]),
]


@pytest.mark.parametrize(("module", "names"), DOCUMENTED_BEFORE_LAYOUT, ids=lambda x: str(x))
def test_documented_names_import_from_their_documented_paths(module: str, names: list[str]) -> None:
    mod = importlib.import_module(module)
    missing = [n for n in names if not hasattr(mod, n)]
    assert not missing, f"{module} no longer provides {missing}"


def test_old_engine_paths_are_the_same_objects_as_the_new_ones() -> None:
    from verst.rollout.engines.embedded.engine import EmbeddedEngine
    from verst.rollout.engines.serve.inprocess_openai import InProcessOpenAI
    from verst.rollout.engines.sglang.client import SGLangClient

    assert importlib.import_module("verst.rollout.engines.embedded").EmbeddedEngine is EmbeddedEngine
    assert importlib.import_module("verst.rollout.engines.sglang_client").SGLangClient is SGLangClient
    assert importlib.import_module("verst.rollout.engines.sglang").SGLangClient is SGLangClient
    assert (
        importlib.import_module("verst.rollout.engines.inprocess_openai").InProcessOpenAI is InProcessOpenAI
    )


_FROM = re.compile(r"^\s*from (verst[\w.]*) import \(?([\w, ]+)", re.MULTILINE)
_DOTTED = re.compile(r"(?<![\w./])(verst(?:\.\w+)+)(?::(\w+))?")


def _doc_texts() -> list[Path]:
    files = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    return files + sorted(p for p in (ROOT / "examples").rglob("*") if p.suffix in {".py", ".md", ".toml"})


def _references() -> set[tuple[str, str]]:
    refs: set[tuple[str, str]] = set()
    for path in _doc_texts():
        text = path.read_text("utf-8")
        for module, names in _FROM.findall(text):
            refs.update((module, n.strip()) for n in names.split(",") if n.strip())
        for dotted, attr in _DOTTED.findall(text):
            refs.add((dotted, attr))
    return refs


def _resolve(dotted: str, attr: str) -> None:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as e:
            if e.name is None or not ".".join(parts[:cut]).startswith(e.name):
                raise
            continue
        for name in parts[cut:] + ([attr] if attr else []):
            obj = getattr(obj, name)
        return
    raise ModuleNotFoundError(dotted)


def test_every_verst_path_the_docs_name_resolves() -> None:
    refs = _references()
    assert len(refs) > 50, "the docs scan found too few references; is the pattern broken?"
    broken = []
    for dotted, attr in sorted(refs):
        try:
            _resolve(dotted, attr)
        except (ImportError, AttributeError) as e:
            broken.append(f"{dotted}{':' + attr if attr else ''}: {type(e).__name__}: {e}")
    assert not broken, "docs name paths that do not import:\n" + "\n".join(broken)
