"""vLLM's routed experts on the wire (default suite; the real server is
tests/real_engines/test_vllm_moe.py).

vLLM 0.32 (`--enable-return-routed-experts`) puts in every choice `routed_experts`: base64 of a
`.npy` array `[prompt + output - 1 - start, layers, k]` written by numpy (`numpy2base64`); the
request's `sampling_params.routed_experts_prompt_start` is `start`. The `.npy` reader is checked
as a property against numpy's own writer, for every dtype vLLM sends.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_vllm_client import RECORDED, _info, _stub

from verst.rollout.engine import EngineError, GenerateRequest, SamplingParams
from verst.rollout.engines.config import parse_engine_config
from verst.rollout.engines.vllm.client import VllmClient
from verst.rollout.engines.vllm.launcher import VllmServerSpec, server_command, server_env
from verst.rollout.engines.vllm.wire import generate_json, parse_generate
from verst.rollout.moe import RoutedExperts


def numpy2base64(array: np.ndarray) -> str:
    """vLLM's encoder (`vllm/utils/serial_utils.py`), verbatim but for pybase64."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(["uint8", "uint16", "int32"]),
    shape=st.tuples(st.integers(0, 9), st.integers(1, 4), st.integers(1, 3)),
    seed=st.integers(0, 2**16),
)
def test_npy_routing_reads_back_exactly(dtype, shape, seed):
    top = 255 if dtype == "uint8" else 1000
    ids = np.random.default_rng(seed).integers(0, top, size=shape).astype(dtype)
    got = RoutedExperts.from_npy(numpy2base64(ids))
    assert got.tokens == shape[0] and got.width == shape[1] * shape[2]
    assert got.to_ints() == ids.reshape(-1).astype(int).tolist()


def _answer(routing: np.ndarray | None) -> dict:
    choice = dict(RECORDED["choices"][0])
    choice["routed_experts"] = None if routing is None else numpy2base64(routing)
    return {**RECORDED, "choices": [choice]}


def _request(start: int = 0) -> GenerateRequest:
    return GenerateRequest(
        RECORDED["prompt_token_ids"],
        SamplingParams(),
        return_routed_experts=True,
        routed_experts_start_len=start,
    )


def test_a_choice_with_routing_parses_into_the_output():
    positions = len(RECORDED["prompt_token_ids"]) + len(RECORDED["choices"][0]["token_ids"]) - 1 - 1
    rows = np.arange(positions * 2 * 2).reshape(-1, 2, 2) % 8  # [positions, layers, k], start 1
    (out,) = parse_generate(_answer(rows.astype("uint8")), _request(start=1), 0)
    assert out.routed_experts is not None and out.routed_experts.tokens == positions
    assert out.routed_experts.to_ints() == rows.reshape(-1).tolist()
    body = generate_json(_request(start=1), "r1")
    assert body["sampling_params"]["routed_experts_prompt_start"] == 1
    (plain,) = parse_generate(_answer(None), _request(), 0)  # a server without the flag
    assert plain.routed_experts is None
    with pytest.raises(EngineError, match="routed experts for 2 positions"):
        parse_generate(_answer(rows[:2].astype("uint8")), _request(start=1), 0)


def test_the_config_declares_the_capability_and_the_launcher_adds_the_flag():
    for table in ({"type": "vllm", "urls": ["http://127.0.0.1:1"]}, {"type": "vllm_launch", "device": "cpu"}):
        assert not parse_engine_config(table).capabilities().routing_replay
        assert parse_engine_config({**table, "routed_experts": True}).capabilities().routing_replay
    spec = VllmServerSpec(python="python", model_path="m", routed_experts=True)
    assert "--enable-return-routed-experts" in server_command(spec, host="127.0.0.1", port=1)
    assert server_env(spec, 0)["VLLM_USE_V2_MODEL_RUNNER"] == "1"


async def test_a_server_without_routed_experts_is_named_before_the_run():
    on = _info()
    on["vllm_config"]["aux_output_config"] = {"enable_return_routed_experts": True}
    for info, ok in ((_info(), False), (on, True)):
        runner, url = await _stub(info=info)
        client = VllmClient(url, max_retries=0)
        try:
            problems = await client.check(lora=True, routed=True)
            assert (problems == []) == ok, problems
            assert ok or "--enable-return-routed-experts" in problems[0].fix
        finally:
            await client.close()
            await runner.cleanup()
