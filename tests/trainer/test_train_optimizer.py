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


def test_float32_step_bypasses_accelerates_wrapper_with_the_same_result(tiny_checkpoint):
    """Without a gradient scaler accelerate's optimizer wrapper only passes `step` on, so
    `optimizer_step` steps the torch optimizer itself: the weights, optimizer state and lr after
    three steps are bitwise those of stepping through the wrapper."""
    from accelerate.optimizer import AcceleratedOptimizer

    from verst.trainer.train.fsdp import clip_grad_norm
    from verst.trainer.train.optim import optimizer_step, stepping_optimizer, trainable

    def side():
        cfg = TrainConfig(model_path=str(tiny_checkpoint), lr=1e-2, max_grad_norm=0.5)
        return TrainSide(
            cfg, AlgorithmConfig(), model_path=str(tiny_checkpoint), total_steps=3, max_response_len=4,
            temperature=1.0, env={},
        )  # fmt: skip

    direct, wrapped = side(), side()
    assert isinstance(direct.bundle.optimizer, AcceleratedOptimizer)
    assert stepping_optimizer(direct.bundle.optimizer) is direct.bundle.raw_optimizer()
    for step in range(3):
        for s in (direct, wrapped):
            torch.manual_seed(step)
            for p in s.bundle.module.parameters():
                p.grad = torch.randn_like(p)
        optimizer_step(direct.bundle.module, direct.bundle.optimizer, direct.bundle.scheduler, 0.5)
        b = wrapped.bundle  # the wrapper's own path, as before
        clip_grad_norm(trainable(b.module), 0.5)
        b.optimizer.step()
        b.scheduler.step()
        b.optimizer.zero_grad(set_to_none=True)
    for (name, p), q in zip(
        direct.bundle.module.named_parameters(), wrapped.bundle.module.parameters(), strict=True
    ):
        assert torch.equal(p, q), name
        assert p.grad is None and q.grad is None
    sa, sb = direct.bundle.raw_optimizer().state_dict(), wrapped.bundle.raw_optimizer().state_dict()
    for k in sa["state"]:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa["state"][k][field], sb["state"][k][field])
    assert direct.bundle.raw_scheduler().last_epoch == wrapped.bundle.raw_scheduler().last_epoch == 3


def test_a_gradient_scaler_keeps_accelerates_wrapper():
    """fp16's gradient scaler lives in the wrapper's `step`: then the wrapper is stepped."""
    from accelerate import Accelerator

    from verst.trainer.train.optim import stepping_optimizer

    model = torch.nn.Linear(2, 2)
    opt = Accelerator(cpu=True).prepare(torch.optim.AdamW(model.parameters()))
    assert stepping_optimizer(opt) is opt.optimizer
    opt.scaler = torch.amp.GradScaler("cpu")
    assert stepping_optimizer(opt) is opt
    plain = torch.optim.AdamW(model.parameters())
    assert stepping_optimizer(plain) is plain
