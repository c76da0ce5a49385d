"""AdamW runs its fused kernel where it can (unsharded CPU/CUDA parameters), and the fused
kernel takes the same steps as torch's default implementation."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.trainer.algorithms import AlgorithmConfig
from verst.trainer.config import TrainConfig
from verst.trainer.train.optim import fused_adamw
from verst.trainer.train.side import TrainSide


def test_train_side_uses_fused_adamw_on_cpu(tiny_checkpoint):
    cfg = TrainConfig(model_path=str(tiny_checkpoint), lr=1e-3)
    side = TrainSide(
        cfg, AlgorithmConfig(), model_path=str(tiny_checkpoint), total_steps=1, max_response_len=4,
        temperature=1.0, env={},
    )  # fmt: skip
    assert side.bundle.raw_optimizer().param_groups[0]["fused"] is True


def test_fused_only_for_unsharded_float_parameters():
    p = torch.nn.Parameter(torch.zeros(3))
    assert fused_adamw([p], fsdp=False) is True
    assert fused_adamw([p], fsdp=True) is None  # DTensor parameters: torch's default
    assert fused_adamw([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))], fsdp=False) is None
    assert fused_adamw([], fsdp=False) is None


@settings(max_examples=25, deadline=None)
@given(
    lr=st.floats(1e-5, 1e-1),
    wd=st.sampled_from([0.0, 0.01, 0.1]),
    beta2=st.sampled_from([0.99, 0.999]),
    seed=st.integers(0, 2**16),
)
def test_fused_adamw_matches_default(lr, wd, beta2, seed):
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(7, 5, generator=g), torch.randn(11, generator=g)]
    grads = [[torch.randn(t.shape, generator=g) for t in init] for _ in range(4)]
    results = []
    for fused in (None, True):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, beta2), weight_decay=wd, fused=fused)
        for step in grads:
            for p, gr in zip(params, step, strict=True):
                p.grad = gr.clone()
            opt.step()
        results.append([p.detach() for p in params])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
