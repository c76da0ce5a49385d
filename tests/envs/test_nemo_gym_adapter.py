"""The NeMo Gym adapter over HTTP against `nemo_gym_stub` (a minimal in-repo implementation of
NeMo Gym's resources-server interface: the package itself cannot be installed next to the
lock; see that module's docstring). Episodes run end to end through verst's rollout on the
embedded engine: seed, tool call, verify."""

from __future__ import annotations

import json

import nemo_gym_stub
import pytest
from aiohttp import web
from envs_testlib import RecordingEngine, assert_exact_trajectory, lifecycle_closed, run_rollout

from verst.rollout.agentic import ModelTurn
from verst.rollout.config import DataConfig
from verst.rollout.data_sources import build_data_source
from verst.rollout.engines.sglang.launcher import free_port
from verst.rollout.integrations._common import EnvFailure
from verst.rollout.integrations.nemo_gym_env import NemoGymEnvironment, NemoGymOptions
from verst.rollout.sample import Sample, Status

ROW = {
    "responses_create_params": {
        "input": [{"role": "user", "content": "add 2 and 3"}],
        "tools": [
            {
                "type": "function",
                "name": "add",
                "description": "add two integers",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                },
                "strict": True,
            }
        ],
    },
    "expected_answer": "5",
}


async def _serve(app):
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture()
def rows(tmp_path):
    path = tmp_path / "example.jsonl"
    path.write_text(json.dumps(ROW) + "\n")
    return path


async def test_episodes_seed_call_tools_and_verify(tool_model, rows):
    from verst.rollout.engines.embedded.engine import EmbeddedEngine

    runner, url = await _serve(nemo_gym_stub.build_app())
    engine = EmbeddedEngine.from_pretrained(tool_model, num_threads=1)
    try:
        rec = RecordingEngine(engine)
        source = build_data_source(DataConfig(source="nemo_gym", options={"path": str(rows)}), 2)
        env = {"type": "nemo_gym", "options": {"resources_server_url": url}, "max_turns": 3}
        result, _, sink = await run_rollout(rec, engine.tokenizer, source, env)
        (group,) = result.groups
        for s in group:
            assert s.status is Status.COMPLETED and s.reward == 1.0
            assert s.metadata["env_info"]["nemo_gym"]["tool_calls_seen"] == 1
            assert s.metadata["env_metrics"]["tool_calls"] == 1.0
            assert assert_exact_trajectory(s, rec.calls) == 2
            assert "tool: 5" in engine.tokenizer.decode(s.tokens)
        lifecycle_closed(sink.events)
    finally:
        await engine.close()
        await runner.cleanup()


async def _episode(url, row, text, timeout_s=5.0):
    env = NemoGymEnvironment(NemoGymOptions(resources_server_url=url, timeout_s=timeout_s))
    try:
        await env.reset(Sample(prompt="p", label=row))
        return await env.step(ModelTurn(0, (1,), text, "stop"))
    finally:
        await env.close()


async def test_faults_are_env_failures_with_their_reason():
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    runner, url = await _serve(nemo_gym_stub.build_app(tool_delay_s=2.0))
    try:
        with pytest.raises(EnvFailure, match=r"nemo_gym environment failed \(timeout\): POST /add timed out"):
            await _episode(url, ROW, call, timeout_s=0.5)
        with pytest.raises(
            EnvFailure, match=r"\(http_error\): POST /verify answered 500: .*judge is unavailable"
        ):
            await _episode(url, {**ROW, "fail_verify": True}, "5")
    finally:
        await runner.cleanup()
    with pytest.raises(EnvFailure, match=r"\(http_error\): POST /seed_session: ClientConnectorError"):
        await _episode(f"http://127.0.0.1:{free_port()}", ROW, "5")
    with pytest.raises(EnvFailure, match=r"\(malformed\)"):
        await _episode(url, {"not": "a row"}, "5")


def test_bad_rows_name_file_and_line(tmp_path):
    from verst.rollout.errors import DataError

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROW) + "\n" + json.dumps({"input": []}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: not a NeMo Gym row"):
        build_data_source(DataConfig(source="nemo_gym", options={"path": str(path)}), 1)


async def test_an_env_that_always_fails_stops_the_rollout_instead_of_hanging(tool_model, tmp_path):
    """Every episode's /verify answers 500: each group is retried, then marked FAILED; once more
    groups failed in a row than the batch holds, the rollout stops with an error naming the cause
    (the data source would otherwise be cycled forever)."""
    from verst.rollout.engines.embedded.engine import EmbeddedEngine
    from verst.rollout.errors import RolloutFailedError

    path = tmp_path / "fail.jsonl"
    path.write_text(json.dumps({**ROW, "fail_verify": True}) + "\n")
    runner, url = await _serve(nemo_gym_stub.build_app())
    engine = EmbeddedEngine.from_pretrained(tool_model, num_threads=1)
    try:
        source = build_data_source(DataConfig(source="nemo_gym", options={"path": str(path)}), 2)
        env = {"type": "nemo_gym", "options": {"resources_server_url": url}, "max_turns": 3}
        with pytest.raises(RolloutFailedError, match=r"2 groups in a row failed .*POST /verify answered 500"):
            await run_rollout(engine, engine.tokenizer, source, env)
    finally:
        await engine.close()
        await runner.cleanup()
