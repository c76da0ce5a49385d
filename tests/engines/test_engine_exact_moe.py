"""`train.exact_on_policy` on an MoE (Qwen3-MoE, Mixtral): the embedded engine's log-probs equal
the trainer's bit for bit, with free routing and with the engine's routing replayed (R3).

The tiny MoE of `verst.rollout.toy_moe` (8 experts, top-2, random init), sampled at temperature
1 in continuous batches of 1, 5 and 64 rows with prefix sharing (the engine records its experts
per position); the trainer's exact path (`install_exact`, `PolicyLogprobs` "exact", padded rows)
over the same tokens: free routing gives every token's engine value, the trainer's routers pick
exactly the engine's experts, and replaying the engine's recorded experts
(`verst.rollout.moe.RouterHooks`, recomputed gate weights) gives the same bits again. The
router and expert ops are checked batch-invariant under hypothesis, against the plain ones.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.exact_ops import exact_experts, exact_router


@pytest.fixture(scope="module", params=["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def moe_dir(request, tmp_path_factory):
    from verst.rollout.toy_moe import make_tiny_moe_checkpoint

    return str(make_tiny_moe_checkpoint(tmp_path_factory.mktemp(request.param), family=request.param, seed=3))


async def _engine_run(path: str, batch: int, exact: bool):
    from verst.rollout.engines.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine.from_pretrained(path, max_batch_size=batch)
    if exact:
        engine.enable_exact_on_policy()
    tok = engine.tokenizer
    prompts = [tok(p)["input_ids"] for p in ("123=", "98765=", "4040404=")]
    reqs = [
        GenerateRequest(
            p,
            SamplingParams(max_new_tokens=4 + i % 7, temperature=1.0, sampling_seed=i),
            return_routed_experts=True,
        )
        for i, p in enumerate(p for p in prompts for _ in range(4))
    ]
    outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
    await engine.close()
    return reqs, outs


def _trainer(path: str):
    from transformers import AutoModelForCausalLM

    from verst.rollout.exact_model import install_exact

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    install_exact(model)
    return model


def _compare(model, reqs, outs, replay: bool) -> tuple[int, int, int]:
    """(tokens checked, log-prob mismatches, positions whose free routing differs from the engine's)."""
    from verst.rollout.moe import UNRECORDED, RouterHooks
    from verst.trainer.train.logprobs import PolicyLogprobs, pack_sequences

    tokens = [list(r.input_ids) + list(o.output_ids) for r, o in zip(reqs, outs, strict=True)]
    lengths = [len(o.output_ids) for o in outs]
    inputs = pack_sequences(tokens, lengths, layout="padded")
    rows, width = inputs.input_ids.shape
    hooks = RouterHooks(model)
    table = torch.full((rows, width, hooks.layers, hooks.k), UNRECORDED, dtype=torch.long)
    for i, o in enumerate(outs):
        rec = o.routed_experts.to_tensor().reshape(-1, hooks.layers, hooks.k)  # positions [0, L-1)
        table[i, : rec.shape[0]] = rec
    flat = table.reshape(rows * width, hooks.layers, hooks.k)
    hooks.replay = flat if replay else None
    try:
        with torch.no_grad():
            lp = PolicyLogprobs(model, backend="exact")(inputs)[0]
        chosen = hooks.free_choice()
    finally:
        hooks.close()
    seen = flat[:, :, 0] >= 0
    routing_diff = int(((chosen != flat).any(-1) & seen).sum())
    engine = torch.tensor([x for o in outs for x in o.output_logprobs])
    return engine.numel(), int((lp != engine).sum()), routing_diff


@pytest.mark.parametrize(
    "batch", [pytest.param(1, marks=pytest.mark.slow), 5, pytest.param(64, marks=pytest.mark.slow)]
)
def test_moe_logprobs_equal_the_trainers_with_and_without_replay(moe_dir, batch):
    torch.set_num_threads(2)
    reqs, outs = asyncio.run(_engine_run(moe_dir, batch, exact=True))
    model = _trainer(moe_dir)
    for replay in (False, True):
        checked, mismatched, routing_diff = _compare(model, reqs, outs, replay)
        assert checked > 50
        assert (mismatched, routing_diff) == (0, 0), f"replay={replay}: {mismatched}/{checked} differ"


def test_moe_differs_without_the_switch(moe_dir):
    """The control: the default engine (transformers' experts kernels) vs the trainer's exact path."""
    torch.set_num_threads(2)
    reqs, outs = asyncio.run(_engine_run(moe_dir, 5, exact=False))
    _, mismatched, _ = _compare(_trainer(moe_dir), reqs, outs, replay=True)
    assert mismatched > 0


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(1, 300),
    experts=st.sampled_from([4, 8, 16]),
    k=st.sampled_from([1, 2, 4]),
    hidden=st.sampled_from([32, 128]),
    inter=st.sampled_from([16, 64]),
    seed=st.integers(0, 2**16),
    threads=st.sampled_from([1, 2]),
)
def test_router_and_experts_token_is_the_same_for_any_batch(n, experts, k, hidden, inter, seed, threads):
    """One token's router output and expert mix, alone and at any place in a batch of `n`."""
    torch.set_num_threads(threads)
    k = min(k, experts)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(experts, hidden, generator=g)
    gate_up, down = (
        torch.randn(experts, 2 * inter, hidden, generator=g),
        torch.randn(experts, hidden, inter, generator=g),
    )
    batch = torch.randn(n, hidden, generator=g)
    at = seed % n

    def run(x):
        logits, weights, ids = exact_router(x, w, k, True)
        return logits, weights, ids, exact_experts(x, ids, weights, gate_up, down)

    alone = run(batch[at : at + 1])
    together = run(batch)
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(a[0], b[at])


def test_plain_experts_depend_on_the_batch():
    """What `exact_experts` fixes: transformers' experts give a token other bits in a batch."""
    from verst.rollout.toy_moe import build_tiny_moe

    torch.set_num_threads(1)
    model = build_tiny_moe("qwen3_moe", 64, seed=0)
    block = model.model.layers[0].mlp
    x = torch.randn(1, 40, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        together = block(x)[0]
        alone = torch.stack([block(x[:, i : i + 1])[0, 0] for i in range(40)])
    assert not torch.equal(together, alone)
