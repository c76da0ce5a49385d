"""The NeMo Gym adapter against a real resources server that nemo-gym 0.4.0 ships
(`example_single_tool_call`: a `get_weather` tool and a verify that rewards 1.0), run from
nemo-gym's own Python 3.12 venv (it cannot share the project's lock): seed a session with a row
of the server's own example data, call its tool through a model turn, answer, verify.

    python3.12 -m venv ~/.cache/verst/nemo-gym-0.4.0 && ~/.cache/verst/nemo-gym-0.4.0/bin/pip install nemo-gym==0.4.0

Skips with that line without the venv (fails under VERST_REQUIRE_NEMO_GYM=1)."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import vllm_env
from require_testlib import unavailable

from verst.rollout.agentic import ModelTurn
from verst.rollout.engines.sglang.launcher import free_port
from verst.rollout.integrations.nemo_gym_env import NemoGymEnvironment, NemoGymOptions
from verst.rollout.sample import Sample

pytestmark = pytest.mark.real_engine

SERVER = "example_single_tool_call"
HOW_TO = (
    "nemo-gym 0.4.0 is not available: `python3.12 -m venv ~/.cache/verst/nemo-gym-0.4.0 && "
    "~/.cache/verst/nemo-gym-0.4.0/bin/pip install nemo-gym==0.4.0`"
)


@pytest.fixture(scope="module")
def nemo_gym_url(tmp_path_factory):
    python = vllm_env.cache_dir() / "nemo-gym-0.4.0" / "bin" / "python"
    if not python.exists():
        unavailable("VERST_REQUIRE_NEMO_GYM", HOW_TO)
    port = free_port()
    log = tmp_path_factory.mktemp("nemo-gym") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(python), str(Path(__file__).with_name("nemo_gym_serve.py")), SERVER, str(port)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            req = urllib.request.Request(
                f"{url}/seed_session", data=b"{}", headers={"content-type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=5):
                break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail(f"nemo-gym's {SERVER} did not start: {log.read_text()[-2000:]}")
    yield url, python
    proc.terminate()
    proc.wait(10)


def _example_row(python: Path) -> dict:
    code = (
        "import resources_servers, os; "
        f"print(os.path.join(list(resources_servers.__path__)[0], {SERVER!r}, 'data', 'example.jsonl'))"
    )
    path = subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    return json.loads(Path(path).read_text().splitlines()[0])


async def test_a_real_resources_server_through_the_adapter(nemo_gym_url):
    url, python = nemo_gym_url
    row = _example_row(python)
    env = NemoGymEnvironment(NemoGymOptions(resources_server_url=url, timeout_s=30.0))
    try:
        first = await env.reset(Sample(prompt="p", label=row))
        assert any(m["role"] == "user" and "sf" in m["content"] for m in first.messages)
        assert [t["function"]["name"] for t in first.tools] == ["get_weather"]
        call = '<tool_call>{"name": "get_weather", "arguments": {"city": "San Francisco"}}</tool_call>'
        step = await env.step(ModelTurn(0, (1,), call, "stop"))
        assert not step.done
        (reply,) = step.observation.messages
        assert reply["role"] == "tool" and "The weather in San Francisco is cold." in reply["content"]
        final = await env.step(ModelTurn(1, (1,), "It is cold in San Francisco.", "stop"))
        assert final.done and final.reward == 1.0
    finally:
        await env.close()
