"""The verifiers adapter against the real `verifiers` package (0.1.x): a ToolEnv defined here,
loaded by `vf.load_environment`, run end to end by verst's rollout on the embedded engine."""

from __future__ import annotations

import textwrap

import pytest
from envs_testlib import RecordingEngine, assert_exact_trajectory, lifecycle_closed, run_rollout

from verst.rollout.config import DataConfig
from verst.rollout.data_sources import build_data_source
from verst.rollout.sample import Status

ENV_MODULE = textwrap.dedent(
    '''
    """A tiny verifiers ToolEnv: add two numbers with the `add` tool, then answer."""
    import verifiers as vf
    from datasets import Dataset


    def add(a: int, b: int) -> int:
        """add two integers"""
        return a + b


    def correct(completion, answer, **kwargs) -> float:
        last = [m for m in completion if m["role"] == "assistant"][-1]
        return 1.0 if (last.get("content") or "").strip() == answer else 0.0


    class Broken(vf.ToolEnv):
        """The tool server is down for example 0 only."""

        async def env_response(self, messages, state, **kwargs):
            if state["example_id"] == 0:
                raise RuntimeError("the tool server is down")
            return await super().env_response(messages, state, **kwargs)


    def load_environment(broken: bool = False, **kwargs):
        ds = Dataset.from_list([{"question": "add 2 and 3", "answer": "5"}] * (2 if broken else 1))
        cls = Broken if broken else vf.ToolEnv
        return cls(dataset=ds, tools=[add], rubric=vf.Rubric(funcs=[correct]), max_turns=3)
    '''
)


@pytest.fixture(scope="module")
def vf_module(tmp_path_factory):
    root = tmp_path_factory.mktemp("vf_env")
    (root / "tiny_vf_env.py").write_text(ENV_MODULE)
    import sys

    sys.path.insert(0, str(root))
    yield "tiny-vf-env"
    sys.path.remove(str(root))


@pytest.fixture(scope="module")
def engine(tool_model):
    from verst.rollout.engines.embedded.engine import EmbeddedEngine

    return EmbeddedEngine.from_pretrained(tool_model, num_threads=1)


async def test_tool_env_episodes_end_to_end(engine, vf_module):
    rec = RecordingEngine(engine)
    options = {"env_id": vf_module}
    source = build_data_source(DataConfig(source="verifiers", options=options), 2)
    env = {"type": "verifiers", "options": options, "max_turns": 3}
    result, _strategy, sink = await run_rollout(rec, engine.tokenizer, source, env)
    (group,) = result.groups
    for s in group:
        assert s.status is Status.COMPLETED and s.reward == 1.0
        assert s.metadata["env_info"]["stop_condition"] == "no_tools_called"
        assert s.metadata["env_info"]["metrics"]["correct"] == 1.0
        assert s.metadata["termination"] == "env_done"
        assert assert_exact_trajectory(s, rec.calls) == 2  # the tool call, then the answer
        text = engine.tokenizer.decode(s.tokens)
        assert "tools: add" in text and "tool: 5" in text
    lifecycle_closed(sink.events)


async def test_a_raising_env_fails_its_group_and_the_rollout_goes_on(engine, vf_module):
    """Example 0's environment raises: its groups are retried, then FAILED with the reason and
    counted; example 1's groups fill the batch."""
    options = {"env_id": vf_module, "env_args": {"broken": True}}
    source = build_data_source(DataConfig(source="verifiers", options={**options, "shuffle": False}), 2)
    env = {"type": "verifiers", "options": options, "max_turns": 3}
    result, strategy, sink = await run_rollout(
        engine, engine.tokenizer, source, env, batch_size=2, max_group_retries=1
    )
    assert result.metrics["rollout/failed_groups"] >= 1.0
    assert [s.metadata["verifiers"]["example_id"] for g in result.groups for s in g] == [1] * 4
    assert all(s.reward == 1.0 for g in result.groups for s in g)
    group = strategy.last_failed_groups[0]
    assert all(s.status is Status.FAILED and s.metadata["verifiers"]["example_id"] == 0 for s in group)
    assert (
        "verifiers environment failed (exception): env_response: RuntimeError: the tool server is down"
        in (group[0].metadata["error"])
    )
    lifecycle_closed(sink.events)


def test_missing_env_and_group_rubrics_are_clear_errors(vf_module, tmp_path, monkeypatch):
    from verst.rollout.agentic import EnvConfig
    from verst.rollout.agentic.environment import EnvSetup
    from verst.rollout.agentic.loading import build_env_factory

    with pytest.raises(Exception, match="no_such_env"):
        build_env_factory(EnvConfig(type="verifiers", options={"env_id": "no_such_env"}), EnvSetup())
    (tmp_path / "group_vf_env.py").write_text(
        ENV_MODULE.replace(
            "rubric=vf.Rubric(funcs=[correct])",
            "rubric=vf.Rubric(funcs=[lambda completions, **k: [0.0] * len(completions)])",
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TypeError, match="group-level reward functions"):
        build_env_factory(EnvConfig(type="verifiers", options={"env_id": "group_vf_env"}), EnvSetup())
