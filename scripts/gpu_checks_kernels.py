"""The GPU-only numeric stages of `scripts/gpu_check.py`: `kernels` (the compiled Triton
kernels vs float64 at T=32,768 x V=151,936 bf16, their time vs the measured copy bandwidth, a
[B,T+1,V][:, :-1] slice read in place, the OPD backward's registers and spills) and `engine`
(the embedded engine's grouped-query attention vs transformers' SDPA on CUDA). Both need CUDA;
`gpu_check.py` does not start them without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gpu_checks import Recorder


# ----------------------------------------------------------------------------------- kernels
def _cuda_ms(fn: Callable[[], Any], repeat: int = 3) -> float:
    import torch

    fn()  # warm-up / compile
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def _ref_rows(x: Any, targets: Any, T: float, g_lp: Any, g_ent: Any | None) -> tuple[Any, Any, Any]:
    """float64 log-probs [n, M], entropy [n] and grad wrt x [n, V] for upstream g_lp/g_ent."""
    import torch

    z = x.double() / T
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    ent = -(p * logp).sum(-1)
    lp = logp.gather(-1, targets)
    grad = -p * g_lp.double().sum(-1, keepdim=True)
    grad.scatter_add_(-1, targets, g_lp.double())
    if g_ent is not None:
        grad -= g_ent.double()[:, None] * p * (logp + ent[:, None])
    return lp, ent, grad / T


def _max_err(a: Any, b: Any) -> float:
    return float((a.double() - b.double()).abs().max())


def kernels(summary: Recorder) -> None:
    import torch
    import triton

    from verst.kernels import token_logprobs, topk_logprobs
    from verst.kernels._kernels import _row_backward_kernel
    from verst.kernels._launchers import _block_m, _block_v, _num_warps

    if not torch.cuda.is_available():
        raise RuntimeError("the kernels stage needs a CUDA device")  # the driver does not start it without
    dev = torch.device("cuda")
    torch.manual_seed(0)
    T_, V, temp = 32_768, 151_936, 0.8
    bw = 0.0
    with summary.check("kernels/copy_bandwidth") as info:
        x = torch.randn(T_, V, device=dev, dtype=torch.bfloat16).mul_(4)  # 9.3 GiB, > 2^31 elements
        copy = torch.empty_like(x)
        ms = _cuda_ms(lambda: copy.copy_(x))
        bw = 2 * x.numel() * x.element_size() / (ms / 1e3)
        copy.set_()  # free it
        info["detail"] = (
            f"{bw / 1e12:.2f} TB/s (read+write of {x.numel() * 2 / 2**30:.1f} GiB in {ms:.2f} ms)"
        )
    with summary.check("kernels/token_logprobs_T32768_V151936_bf16") as info:
        targets = torch.randint(0, V, (T_,), device=dev)
        xg = x.requires_grad_()
        fwd_ms = _cuda_ms(lambda: token_logprobs(x.detach(), targets, temp, return_entropy=True))
        lp, ent = token_logprobs(xg, targets, temp, return_entropy=True)
        g_lp, g_ent = torch.randn(T_, device=dev), torch.randn(T_, device=dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        end.record()
        torch.cuda.synchronize()
        bwd_ms = start.elapsed_time(end)
        worst_lp = worst_ent = worst_g = 0.0
        gmax = 0.0
        for s in range(0, T_, 1024):
            e = min(s + 1024, T_)
            rlp, rent, rg = _ref_rows(x[s:e].detach(), targets[s:e, None], temp, g_lp[s:e, None], g_ent[s:e])
            worst_lp = max(worst_lp, _max_err(lp[s:e], rlp[:, 0]))
            worst_ent = max(worst_ent, _max_err(ent[s:e], rent))
            err = (xg.grad[s:e].double() - rg).abs() - 2.0**-8 * rg.abs()  # bf16 output rounding
            worst_g = max(worst_g, float(err.max()))
            gmax = max(gmax, float(rg.abs().max()))
        bytes_fwd = x.numel() * x.element_size()
        ratio_f = fwd_ms / (bytes_fwd / bw * 1e3)
        ratio_b = bwd_ms / (2 * bytes_fwd / bw * 1e3)
        info["detail"] = (
            f"max|err| lp {worst_lp:.2e} ent {worst_ent:.2e} grad {worst_g:.2e} (of max {gmax:.2e}); "
            f"fwd {fwd_ms:.1f} ms = {ratio_f:.2f}x copy-bound, bwd {bwd_ms:.1f} ms = {ratio_b:.2f}x"
        )
        tol = 2e-5 + 16 * 1.2e-7 * float(x.abs().max()) / temp
        assert worst_lp <= tol and worst_ent <= tol, f"log-prob/entropy error above {tol:.2e}"
        assert worst_g <= 2e-5 * gmax + 1e-6, "gradient error above 2e-5 of its max"
        assert ratio_f < 4 and ratio_b < 4, "slower than 4x the copy-bandwidth bound"
        del lp, ent, xg
        x.grad = None
    del x
    torch.cuda.empty_cache()
    with summary.check("kernels/shifted_slice_read_in_place") as info:
        full = torch.randn(8, 4097, V, device=dev, dtype=torch.bfloat16)  # [B, T+1, V] 9.3 GiB
        tg = torch.randint(0, V, (8, 4096), device=dev)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        lp = token_logprobs(full[:, :-1], tg, 1.0)
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        ref = torch.log_softmax(full[0, :-1].double(), -1).gather(-1, tg[0, :, None])[:, 0]
        info["detail"] = (
            f"extra peak {extra / 2**20:.0f} MiB (a copy would be {full.numel() * 2 / 2**30:.1f} GiB)"
        )
        assert extra < 256 * 2**20, "the slice was copied"
        assert _max_err(lp[0], ref) < 1e-3
        del full, lp
    torch.cuda.empty_cache()
    with summary.check("kernels/opd_backward_M16") as info:
        n, M = 4096, 16
        x = torch.randn(n, V, device=dev, dtype=torch.bfloat16).mul_(4).requires_grad_()
        ids = torch.randint(0, V, (n, M), device=dev)
        out = topk_logprobs(x, M, temp, token_ids=ids)
        g = torch.randn(n, M, device=dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        (out.token_logprobs * g).sum().backward()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end)
        rlp, _, rg = _ref_rows(x.detach()[:512], ids[:512], temp, g[:512], None)
        err_lp = _max_err(out.token_logprobs[:512], rlp)
        err_g = float(((x.grad[:512].double() - rg).abs() - 2.0**-8 * rg.abs()).max())
        # the compiled kernel's registers and spills (launched like TritonRowOps.backward)
        logits = x.detach()
        lse = torch.logsumexp(logits.float() / temp, -1)
        grad = torch.empty_like(logits)
        bv = _block_v(V, None)
        compiled = _row_backward_kernel[(n,)](
            logits, 0, logits.stride(0), n, ids, lse, lse, g, lse, grad, V, M, temp,
            BLOCK_V=bv, BLOCK_M=_block_m(M), WITH_ENTROPY=False, num_warps=_num_warps(bv),
        )  # fmt: skip
        regs, spills = getattr(compiled, "n_regs", -1), getattr(compiled, "n_spills", -1)
        bound = 2 * logits.numel() * 2 / bw * 1e3
        info["detail"] = (
            f"lp err {err_lp:.2e}, grad err {err_g:.2e}; bwd {ms:.1f} ms = {ms / bound:.2f}x copy-bound; "
            f"backward kernel {regs} registers, {spills} spills (triton {triton.__version__})"
        )
        if spills < 0:
            info["detail"] += " (this triton does not expose the spill count)"
        assert err_lp < 1e-3 and err_g < 2e-5 * float(rg.abs().max()) + 1e-6
        assert spills <= 0, "the backward kernel spills registers"


def _decode_run(model: Any, ids: Any, att: Any, pos: Any, feed: Any) -> tuple[Any, float]:
    """Left-padded prefill + one decode step per row of `feed` ([steps, b] token ids, the same
    for both variants, so a flipped argmax cannot make them diverge) → (logits, s per step)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=att, position_ids=pos, past_key_values=cache)
        logits, mask, q = [out.logits[:, -1].float()], att, pos[:, -1:]
        sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for tok in feed:
            mask = torch.cat([mask, mask.new_ones((len(ids), 1))], dim=1)
            q = q + 1
            out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=q, past_key_values=cache)
            logits.append(out.logits[:, -1].float())
        sync()
    return torch.stack(logits), (time.perf_counter() - t0) / len(feed)


def grouped_attention(summary: Recorder) -> None:
    """The embedded engine's grouped-query attention (`engines/embedded/attention.py`) on CUDA: logits of a
    left-padded prefill + 8 decode steps equal transformers' SDPA (fp32 and bf16), and the
    decode-step time of both (64 rows, SmolLM2-135M-like heads: 9 query / 3 KV, head_dim 64)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from verst.rollout.engines.embedded.attention import use_grouped_sdpa

    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 0.1)):
        with summary.check(f"engine/grouped_attention_{str(dtype).split('.')[-1]}") as info:
            cfg = LlamaConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=4, num_attention_heads=9,
                              num_key_value_heads=3, intermediate_size=1536, tie_word_embeddings=True)  # fmt: skip
            torch.manual_seed(0)
            model = LlamaForCausalLM(cfg).to("cuda", dtype).eval()
            b, p = 64, 256
            ids = torch.randint(0, 49152, (b, p), device="cuda")
            att = torch.ones_like(ids)
            for i in range(b):
                att[i, : (i % 8) * 24] = 0
            pos = (att.cumsum(1) - 1).clamp(min=0)
            feed = torch.randint(0, 49152, (8, b), device="cuda")
            _decode_run(model, ids, att, pos, feed)  # warm-up
            want, t_sdpa = _decode_run(model, ids, att, pos, feed)
            assert use_grouped_sdpa(model)
            _decode_run(model, ids, att, pos, feed)
            got, t_grouped = _decode_run(model, ids, att, pos, feed)
            err = float((got - want).abs().max())
            info["detail"] = (
                f"max |logit diff| {err:.2e} (tol {tol}); decode step sdpa {t_sdpa * 1e3:.2f} ms, grouped {t_grouped * 1e3:.2f} ms"
            )
            if not err <= tol:
                info["status"] = "FAIL"
