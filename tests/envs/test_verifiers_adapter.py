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


    class Silent(vf.ToolEnv):
        """Answers a tool call with no messages at all."""

        async def env_response(self, messages, state, **kwargs):
            return []


    def load_environment(broken: bool = False, silent: bool = False, **kwargs):
        ds = Dataset.from_list([{"question": "add 2 and 3", "answer": "5"}] * (2 if broken else 1))
        cls = Broken if broken else Silent if silent else vf.ToolEnv
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


async def test_an_env_response_with_no_messages_is_a_malformed_env_failure(vf_module):
    """#25 item 10: `env_response` returning [] used to become an empty observation, and the
    model generated after its own EOS, silently. The adapter is driven directly with the model
    turn a rollout would pass it (a tool call)."""
    from verst.rollout.agentic import EnvConfig, ModelTurn
    from verst.rollout.agentic.environment import EnvSetup
    from verst.rollout.agentic.loading import build_env_factory
    from verst.rollout.integrations._common import EnvFailure
    from verst.rollout.sample import Sample

    options = {"env_id": vf_module, "env_args": {"silent": True}}
    env = build_env_factory(EnvConfig(type="verifiers", options=options), EnvSetup())()
    await env.reset(Sample(prompt="add 2 and 3", label="5", metadata={"verifiers": {"example_id": 0}}))
    text = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    try:
        with pytest.raises(EnvFailure, match=r"\(malformed\): env_response returned no messages"):
            await env.step(ModelTurn(0, (1, 2), text, "stop"))
    finally:
        await env.close()


def _group_rubric_module(tmp_path, monkeypatch) -> str:
    (tmp_path / "group_vf_env.py").write_text(
        ENV_MODULE.replace(
            "rubric=vf.Rubric(funcs=[correct])",
            "rubric=vf.Rubric(funcs=[lambda completions, **k: [0.0] * len(completions)])",
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "group_vf_env"


def test_missing_env_and_group_rubrics_are_clear_errors(vf_module, tmp_path, monkeypatch):
    from verst.rollout.agentic import EnvConfig
    from verst.rollout.agentic.environment import EnvSetup
    from verst.rollout.agentic.loading import build_env_factory
    from verst.rollout.errors import ConfigError

    with pytest.raises(Exception, match="no_such_env"):
        build_env_factory(EnvConfig(type="verifiers", options={"env_id": "no_such_env"}), EnvSetup())
    env_id = _group_rubric_module(tmp_path, monkeypatch)
    with pytest.raises(ConfigError, match="group-level reward functions"):
        build_env_factory(EnvConfig(type="verifiers", options={"env_id": env_id}), EnvSetup())


def test_a_group_rubric_is_an_exit_2_config_error_before_the_model_loads(
    vf_module, tmp_path, monkeypatch, capsys
):
    """#25 item 10: it used to be a traceback after the model had loaded (exit 1, ~40 s in). The
    model path here is not a model at all, so anything that tried to load it would fail otherwise."""
    from run_testlib import write_prompts

    from verst.rollout.errors import ConfigError
    from verst.rollout.validation import validate_rollout_config
    from verst.trainer.cli import main

    env_id = _group_rubric_module(tmp_path, monkeypatch)
    from verst.rollout.config import RolloutConfig

    with pytest.raises(ConfigError) as info:
        validate_rollout_config(RolloutConfig(env={"type": "verifiers", "options": {"env_id": env_id}}), {})
    (problem,) = [p for p in info.value.problems if p.key == "rollout.env.options.env_id"]
    assert "group-level reward functions" in problem.why and "per-rollout" in problem.fix
    for bad, needle in ((env_id, "group-level reward functions"), ("no_such_env", "no_such_env")):
        cfg = tmp_path / "c.toml"
        cfg.write_text(
            f'[run]\noutput_dir = "{tmp_path / "run"}"\n[train]\nmodel_path = "{tmp_path}"\n'
            f'[rollout.data]\npath = "{write_prompts(tmp_path / "p.jsonl", 2)}"\n'
            f'[rollout.env]\ntype = "verifiers"\n[rollout.env.options]\nenv_id = "{bad}"\n'
        )
        assert main(["train", str(cfg)]) == 2
        err = capsys.readouterr().err
        assert "configuration error" in err and "rollout.env.options.env_id" in err and needle in err
        assert "Traceback" not in err and not (tmp_path / "run").exists()
