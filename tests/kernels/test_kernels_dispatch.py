"""Backend dispatch, input validation and launcher checks (clear errors, no silent misuse)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from kernels_checks import assert_close_report, logprob_tol, make_logits

from verst.kernels import (
    linear_token_logprobs,
    linear_topk_logprobs,
    token_logprobs,
    topk_logprobs,
    triton_available,
)
from verst.kernels._dispatch import resolve_backend
from verst.kernels._launchers import TritonRowOps
from verst.kernels.reference import reference_token_logprobs


def test_triton_available_is_computed_once_and_true_under_interpreter():
    assert triton_available() is True  # tests/conftest.py sets TRITON_INTERPRET=1 before importing triton
    assert triton_available.cache_info().currsize == 1


def test_default_backend_by_device_and_forcing():
    cpu = torch.device("cpu")
    assert resolve_backend(cpu, None) == "torch"
    assert resolve_backend(cpu, "torch") == "torch"
    assert resolve_backend(cpu, "triton") == "triton"  # interpreter mode
    with pytest.raises(ValueError, match="valid choices: triton, torch"):
        resolve_backend(cpu, "cuda")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="interpreter mode"):
        resolve_backend(torch.device("cuda"), "triton")
    with pytest.raises(RuntimeError, match="backend='torch'"):
        resolve_backend(torch.device("meta"), "triton")


@pytest.fixture
def interpreter_off():
    """Turn Triton's interpreter knob off for one test (and recompute the cached availability)."""
    from triton import knobs

    from verst.kernels import _dispatch

    before = knobs.runtime.interpret
    knobs.runtime.interpret = False
    _dispatch._triton_module_state.cache_clear()
    _dispatch.triton_available.cache_clear()
    yield
    knobs.runtime.interpret = before
    _dispatch._triton_module_state.cache_clear()
    _dispatch.triton_available.cache_clear()


def test_forcing_triton_on_cpu_without_interpreter(interpreter_off):
    assert not torch.cuda.is_available()
    assert triton_available() is False
    x = torch.randn(2, 10)
    assert token_logprobs(x, torch.tensor([1, 2])).shape == (2,)  # auto: torch
    with pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1 set before triton is first imported"):
        token_logprobs(x, torch.tensor([1, 2]), backend="triton")


@pytest.mark.slow
def test_forcing_triton_on_cpu_without_interpreter_fresh_process():
    """A fresh process without TRITON_INTERPRET: no GPU here, so Triton cannot run on CPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = textwrap.dedent(
        """
        import torch
        from verst.kernels import token_logprobs, triton_available
        assert not torch.cuda.is_available()
        print("available", triton_available())
        x = torch.randn(2, 10)
        print("auto", token_logprobs(x, torch.tensor([1, 2])).shape)
        try:
            token_logprobs(x, torch.tensor([1, 2]), backend="triton")
        except RuntimeError as e:
            print("error", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "available False" in out.stdout
    assert "auto torch.Size([2])" in out.stdout
    assert "error backend='triton' was forced" in out.stdout and "TRITON_INTERPRET=1" in out.stdout


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_non_contiguous_and_empty_inputs(backend):
    base = make_logits((50, 4), torch.float32, seed=1)
    logits = base.T  # [4, 50], stride along the vocabulary is 4
    targets = torch.tensor([0, 49, 3, 7])
    lp = token_logprobs(logits, targets, 1.0, backend=backend)
    assert_close_report(
        lp, reference_token_logprobs(logits, targets), atol=logprob_tol(logits, 1.0), name="lp"
    )
    empty = token_logprobs(torch.zeros(0, 9), torch.zeros(0, dtype=torch.long), backend=backend)
    assert empty.shape == (0,)
    out = topk_logprobs(torch.zeros(2, 0, 9), 3, backend=backend)
    assert out.values.shape == (2, 0, 3)


def test_public_input_errors():
    x = torch.randn(2, 10)
    t = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="valid: float32, bfloat16, float16"):
        token_logprobs(x.double(), t)
    with pytest.raises(ValueError, match=r"target_ids must have shape \(2,\)"):
        token_logprobs(x, t[:1])
    with pytest.raises(ValueError, match=r"must lie in \[0, V=10\), got values in \[1, 10\]"):
        token_logprobs(x, torch.tensor([1, 10]))
    with pytest.raises(TypeError, match="integer tensor"):
        token_logprobs(x, t.float())
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            token_logprobs(x, t, bad)
    with pytest.raises(ValueError, match=r"k must be in \[1, V=10\]"):
        topk_logprobs(x, 11)
    with pytest.raises(ValueError, match=r"token_ids must have shape \(2,\) \+ \(m,\)"):
        topk_logprobs(x, 2, token_ids=t)
    h, w = torch.randn(3, 4), torch.randn(10, 4)
    with pytest.raises(ValueError, match="must share a dtype"):
        linear_token_logprobs(h, w.half(), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"lm_head_weight must be \[V, H=4\]"):
        linear_token_logprobs(h, w.T, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        linear_topk_logprobs(h, w, 2, chunk_size=0)


def test_launcher_checks():
    x = torch.randn(3, 20)
    t = torch.zeros(3, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="unit stride along the vocabulary"):
        TritonRowOps.forward(torch.randn(20, 3).T, t, 1.0, False)
    with pytest.raises(ValueError, match=r"targets must be torch.int64"):
        TritonRowOps.forward(x, t.int(), 1.0, False)
    with pytest.raises(ValueError, match=r"must be \[N, V\] or \[B, T, V\]"):
        TritonRowOps.forward(x[None, None], t, 1.0, False)
    _, _, lse = TritonRowOps.forward(x, t, 1.0, False)
    with pytest.raises(ValueError, match=r"lse must have shape \(3,\)"):
        TritonRowOps.backward(x, t, 1.0, lse[:2], None, torch.ones(3, 1), None, torch.float32)
    with pytest.raises(ValueError, match="block_v must be a positive power of two"):
        TritonRowOps.topk(x, 2, 1.0, lse, block_v=48)
    with pytest.raises(ValueError, match=r"k must be in \[1, V=20\]"):
        TritonRowOps.topk(x, 21, 1.0, lse)
