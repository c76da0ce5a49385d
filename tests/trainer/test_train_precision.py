"""bf16 compute with fp32 master weights, and flash-attention detection through transformers.

A bf16 update at lr 1e-6 is below half a bf16 ulp of the weights, so bf16 parameters would not
move; with `train.dtype = "bfloat16"` the parameters and AdamW state stay float32 while the
forward (decoder and log-prob kernels) computes in bf16 — on CPU through the same accelerate
autocast a single GPU process uses.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_train_step import _groups

from verst.trainer.algorithms import AlgorithmConfig
from verst.trainer.config import RunConfig, TrainConfig, train_problems
from verst.trainer.train.batch import build_train_batch
from verst.trainer.train.model import mixed_precision_policy, resolve_attn_implementation
from verst.trainer.train.side import TrainSide


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps one process-wide state: a bf16 run after an fp32 one (or before) in the
    same test process would be refused, so reset it around this test."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_bf16_compute_keeps_fp32_masters_that_move_at_tiny_lr(tiny_checkpoint, fresh_accelerate_state):
    torch.set_num_threads(1)
    cfg = TrainConfig(model_path=str(tiny_checkpoint), dtype="bfloat16", lr=1e-6, micro_batch_size=8)
    side = TrainSide(
        cfg,
        AlgorithmConfig(),
        model_path=str(tiny_checkpoint),
        total_steps=2,
        max_response_len=5,
        temperature=1.0,
        env={},
    )
    hf = side.bundle.hf_model
    assert {p.dtype for p in hf.parameters()} == {torch.float32}  # masters
    seen: list[torch.dtype] = []
    linear = next(m for m in hf.get_decoder().modules() if isinstance(m, torch.nn.Linear))
    hook = linear.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    kernel_inputs: list[torch.dtype] = []
    import verst.trainer.train.logprobs as lp_mod

    real = lp_mod.hidden_logprobs

    def spy(hidden, head, *args, **kwargs):  # observe, then run the real function
        kernel_inputs.extend([hidden.dtype, head.weight.dtype])
        return real(hidden, head, *args, **kwargs)

    lp_mod.hidden_logprobs = spy
    try:
        before = {k: v.clone() for k, v in side.state_dict_for_sync().items()}
        side.train_step(build_train_batch(_groups(hf.config.vocab_size)))
    finally:
        lp_mod.hidden_logprobs = real
        hook.remove()
    assert seen and set(seen) == {torch.bfloat16}  # the decoder computed in bf16
    assert kernel_inputs and set(kernel_inputs) == {torch.bfloat16}
    after = side.state_dict_for_sync()
    state = side.bundle.raw_optimizer().state
    assert all(s["exp_avg"].dtype == torch.float32 for s in state.values())
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert moved, "no weight moved at lr 1e-6"
    # bf16 storage could not have held these moves: almost every changed element rounds back
    changed = lost = 0
    for k in moved:
        diff = after[k] != before[k]
        changed += int(diff.sum())
        lost += int((after[k].to(torch.bfloat16) == before[k].to(torch.bfloat16))[diff].sum())
    assert changed > 0 and lost / changed > 0.9, (lost, changed)


def test_fsdp2_mixed_precision_policy():
    policy = mixed_precision_policy("bfloat16")
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert mixed_precision_policy("float32") is None


def test_auto_attention_ignores_a_namespace_flash_attn(tmp_path, monkeypatch):
    # what flash-attn-4 leaves behind: flash_attn/cute/ and no flash_attn/__init__.py
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert importlib.util.find_spec("flash_attn") is not None  # the old check said "installed"
    assert resolve_attn_implementation("auto", cuda=True) == "sdpa"
    cfg = RunConfig.model_validate(
        {"train": {"model_path": "/m", "attn_implementation": "flash_attention_2"}}
    )
    problems = [
        p for p in train_problems(cfg, {}, cuda_available=True) if p.key == "train.attn_implementation"
    ]
    assert len(problems) == 1 and "flash-attn-4" in problems[0].why
