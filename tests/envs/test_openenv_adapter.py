"""The OpenEnv adapter against the real `openenv` package: a small environment defined here,
served by OpenEnv's own `create_app` (uvicorn, loopback) and reached through its
`GenericEnvClient`, and the same environment constructed in process; episodes run end to end
through verst's rollout on the embedded engine. Faults (an unreachable server, a raising step,
an observation without the configured field) are `EnvFailure`s with their reason."""

from __future__ import annotations

import sys
import textwrap
import threading
import time

import pytest
from envs_testlib import RecordingEngine, assert_exact_trajectory, lifecycle_closed, run_rollout

from verst.rollout.agentic import EnvConfig, ModelTurn
from verst.rollout.agentic.environment import EnvSetup
from verst.rollout.agentic.loading import build_env_factory
from verst.rollout.integrations._common import EnvFailure, ListSource
from verst.rollout.sample import Sample, Status

ENV_MODULE = textwrap.dedent(
    '''
    """Count the turns: two steps per episode, reward = 1 for a non-empty message."""
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State


    class SayAction(Action):
        message: str


    class CountObservation(Observation):
        text: str = ""


    class CountEnv(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self, fail_on_step: bool = False):
            super().__init__()
            self.fail_on_step = fail_on_step
            self._state = State(step_count=0)

        def reset(self, seed=None, episode_id=None, **kwargs):
            self._state = State(step_count=0)
            return CountObservation(text=f"seed {seed}: speak", done=False, reward=None)

        def step(self, action, **kwargs):
            if self.fail_on_step:
                raise RuntimeError("the game crashed")
            self._state.step_count += 1
            done = self._state.step_count >= 2
            reward = 1.0 if action.message.strip() else 0.0
            return CountObservation(text=f"turn {self._state.step_count}", done=done, reward=reward)

        @property
        def state(self):
            return self._state
    '''
)


@pytest.fixture(scope="module")
def env_module(tmp_path_factory):
    root = tmp_path_factory.mktemp("openenv_env")
    (root / "tiny_openenv.py").write_text(ENV_MODULE)
    sys.path.insert(0, str(root))
    yield "tiny_openenv"
    sys.path.remove(str(root))


@pytest.fixture(scope="module")
def server(env_module):
    """OpenEnv's FastAPI app for CountEnv under uvicorn on a loopback port."""
    import importlib

    import uvicorn
    from openenv.core.env_server.http_server import create_app

    from verst.rollout.engines.sglang.launcher import free_port

    mod = importlib.import_module(env_module)
    app = create_app(
        mod.CountEnv, mod.SayAction, mod.CountObservation, env_name="count", max_concurrent_envs=8
    )
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.started
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def engine(tool_model):
    from verst.rollout.engines.embedded.engine import EmbeddedEngine

    return EmbeddedEngine.from_pretrained(tool_model, num_threads=1)


def _source():
    return ListSource([Sample(prompt="user: add 2 and 3\n")], 2, shuffle=False, seed=0)


@pytest.mark.parametrize("mode", ["server", "in_process"])
async def test_episodes_end_to_end(engine, server, env_module, mode):
    target = (
        {"base_url": server}
        if mode == "server"
        else {"env_class": f"{env_module}:CountEnv", "action_class": f"{env_module}:SayAction"}
    )
    env = {"type": "openenv", "options": {**target, "observation_field": "text"}, "max_turns": 4}
    rec = RecordingEngine(engine)
    result, _, sink = await run_rollout(rec, engine.tokenizer, _source(), env, max_response_len=8, seed=3)
    (group,) = result.groups
    for s in group:
        assert s.status is Status.COMPLETED and s.metadata["termination"] == "env_done"
        assert s.reward == s.metadata["turn_rewards"][-1] in (0.0, 1.0)
        assert s.metadata["env_info"]["openenv_steps"] == 2
        assert assert_exact_trajectory(s, rec.calls) == 2
        text = engine.tokenizer.decode(s.tokens)
        assert text.startswith("user: add 2 and 3\nseed 3: speak\n") and "turn 1\n" in text
    lifecycle_closed(sink.events)


async def _one_step(options, env_module):
    factory = build_env_factory(EnvConfig(type="openenv", options=options), EnvSetup(seed=0))
    env = factory()
    try:
        await env.reset(Sample(prompt="p"))
        return await env.step(ModelTurn(0, (1,), "hello", "stop"))
    finally:
        await env.close()


async def test_faults_are_env_failures_with_their_reason(server, env_module):
    from verst.rollout.engines.sglang.launcher import free_port

    with pytest.raises(EnvFailure, match=r"openenv environment failed \(http_error\): reset"):
        await _one_step({"base_url": f"http://127.0.0.1:{free_port()}", "connect_timeout_s": 2}, env_module)
    with pytest.raises(EnvFailure, match=r"\(malformed\): the observation has no field 'answer'"):
        await _one_step({"base_url": server, "observation_field": "answer"}, env_module)
    in_process = {
        "env_class": f"{env_module}:CountEnv",
        "action_class": f"{env_module}:SayAction",
        "env_kwargs": {"fail_on_step": True},
    }
    with pytest.raises(EnvFailure, match=r"\(exception\): step: RuntimeError: the game crashed"):
        await _one_step(in_process, env_module)


def test_options_are_validated(env_module):
    from verst.rollout.agentic.loading import env_config_problems

    (p,) = env_config_problems(EnvConfig(type="openenv", options={"observation_field": "x"}))
    assert p.key == "rollout.env.options" and "exactly one of base_url" in p.why
