"""The built-in `python` tool in agentic episodes, with real bwrap: the model's code runs in a
fresh sandbox per call, what it printed comes back (capped) as a loss-masked observation, a
failing program's status is shown, and a call overlaps the generation of another episode.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from agentic_testkit import ScriptEngine, call, context

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sandbox"))
from sandbox_testlib import checked_pool, small_config

from verst.rollout.protocols import RolloutRequest
from verst.rollout.strategies.inference import InferenceRollout


def _options(**python) -> dict:
    checked_pool(small_config())  # skip (or fail under VERST_REQUIRE_BWRAP=1) without bwrap
    sandbox = small_config().model_dump()
    return {"tools": ["python"], "python": {"sandbox": sandbox, **python}}


def _rollout(reply, *, prompts, options, delay_s=0.0):
    engine = ScriptEngine(reply, delay_s=delay_s)
    ctx = context(engine, prompts=prompts, batch_size=len(prompts), env={"type": "tools", "options": options})
    start = time.perf_counter()
    result = asyncio.run(InferenceRollout(ctx)(RolloutRequest(0)))
    return [g[0] for g in result.groups], result.metrics, time.perf_counter() - start


def test_the_output_comes_back_as_a_masked_observation_cut_at_the_cap():
    code = "import os\nprint('pid', os.getpid())\nprint('x' * 500)"

    def reply(conv, req):
        return call("python", code=code) if "</tool_call>" not in conv else "done"

    (sample,), metrics, _ = _rollout(reply, prompts=["q:"], options=_options(max_output_chars=40))
    observation = sample.response.split("<tool_response>")[1].split("</tool_response>")[0]
    assert (
        observation == ("pid 2\n" + "x" * 500)[:40] + "…"
    )  # pid 2: a fresh pid namespace (after bwrap's init)
    env = [g for g in sample.metadata["segments"] if g["source"] == "env"]
    assert env and not any(g["trainable"] for g in env)
    masked = [m for m, g in zip(sample.loss_mask, _positions(sample), strict=True) if g == "env"]
    assert masked and set(masked) == {0}
    assert metrics["rollout/env/tool_calls"] == 1 and metrics["rollout/env/tool_errors"] == 0


def _positions(sample):
    out = []
    for g in sample.metadata["segments"]:
        out += [g["source"]] * g["length"]
    return out


def test_a_failing_program_shows_its_error_and_status():
    def reply(conv, req):
        if "</tool_call>" in conv:
            return "done"
        return (
            call("python", code="import time\ntime.sleep(60)")
            if "slow" in conv
            else call("python", code="1/0")
        )

    samples, _, _ = _rollout(reply, prompts=["crash:", "slow:"], options=_options())
    crash, slow = sorted(samples, key=lambda s: str(s.prompt))
    assert "ZeroDivisionError" in crash.response and "[exit 1]</tool_response>" in crash.response
    assert "[timeout]</tool_response>" in slow.response


def test_a_call_overlaps_another_episodes_generation():
    """Episode `run:` waits ~1.5 s on the tool while episode `think:` waits ~1.5 s on the
    engine; awaited together they take well under the 3 s they would one after the other."""

    def reply(conv, req):
        if "run" in conv:
            return (
                "done"
                if "</tool_call>" in conv
                else call("python", code="import time\ntime.sleep(1.5)\nprint(7)")
            )
        return "done"

    def delay(conv, req):
        return 1.5 if "think" in conv else 0.0

    samples, _, wall = _rollout(reply, prompts=["run:", "think:"], options=_options(), delay_s=delay)
    assert any("<tool_response>7\n</tool_response>" in s.response for s in samples)
    assert wall < 2.6, (
        f"the tool call and the other episode's generation ran one after the other ({wall:.2f} s)"
    )
