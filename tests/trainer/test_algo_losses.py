"""Policy losses, aggregations, KL estimators, entropy and TIS against float64 loop references.

The references are plain Python loops over tokens written from the formulas in
docs/algorithms.md, independent of `verst.trainer.algorithms`.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.trainer.algorithms import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    AlgorithmConfig,
    LossNorm,
    build_algorithm,
)

torch.set_num_threads(1)
SETTINGS = settings(max_examples=60, deadline=None)


# ----------------------------------------------------------------------------- references
def ref_kl(name: str, d: float) -> float:
    if name == "k1":
        return d
    if name == "k2":
        return 0.5 * d * d
    if name == "k3":
        return math.exp(-d) + d - 1.0
    x = min(max(-d, -20.0), 20.0)
    return min(max(math.exp(x) - x - 1.0, -10.0), 10.0)


def ref_aggregate(name: str, loss, mask, max_len: int) -> float:
    B, T = mask.shape
    num_tokens = sum(mask[i, t] for i in range(B) for t in range(T))
    seqs = [i for i in range(B) if sum(mask[i]) > 0]
    if name == "token_mean":
        return sum(loss[i, t] * mask[i, t] for i in range(B) for t in range(T)) / (num_tokens or 1.0)
    if name == "seq_mean_token_mean":
        per = [sum(loss[i, t] * mask[i, t] for t in range(T)) / sum(mask[i]) for i in seqs]
        return sum(per) / (len(seqs) or 1)
    total = sum(loss[i, t] * mask[i, t] for i in range(B) for t in range(T))
    return total / (max_len * (len(seqs) or 1))


def ref_ppo_token(lp, old, a, eps_low, eps_high, c):
    ratio = math.exp(lp - old)
    l1 = -a * ratio
    l2 = -a * min(max(ratio, 1 - eps_low), 1 + eps_high)
    loss = max(l1, l2)
    if c is not None and a < 0:
        loss = min(loss, c * abs(a))
    return loss, l2 > l1


def ref_gspo(lp, old, adv, mask, eps_low, eps_high):
    B, T = mask.shape
    out = np.zeros((B, T))
    for i in range(B):
        n = sum(mask[i])
        s = math.exp(sum((lp[i, t] - old[i, t]) * mask[i, t] for t in range(T)) / max(n, 1.0))
        for t in range(T):
            a = adv[i, t]
            out[i, t] = max(-a * s, -a * min(max(s, 1 - eps_low), 1 + eps_high))
    return out


# ----------------------------------------------------------------------------- strategies
@st.composite
def loss_batches(draw):
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 5))

    def arr(lo, hi):
        vals = draw(st.lists(st.floats(lo, hi, allow_nan=False), min_size=B * T, max_size=B * T))
        return np.array(vals, dtype=np.float64).reshape(B, T)

    lp = arr(-4, 0)
    old = lp + arr(-0.6, 0.6)
    roll = old + arr(-1.5, 1.5)
    ref = lp + arr(-1, 1)
    adv = arr(-3, 3)
    ent = arr(0, 3)
    bits = draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=B * T, max_size=B * T))
    mask = np.array(bits, dtype=np.float64).reshape(B, T)
    return lp, old, roll, ref, adv, ent, mask


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def loss_of(cfg: AlgorithmConfig, b, max_len=7, with_ref=True, with_ent=True):
    lp, old, roll, ref, adv, ent, mask = b
    algo = build_algorithm(cfg)
    logprobs = t(lp).requires_grad_(True)
    out = algo.loss(
        logprobs,
        t(old),
        t(adv),
        t(mask),
        rollout_logprobs=t(roll),
        ref_logprobs=t(ref) if with_ref else None,
        entropy=t(ent) if with_ent else None,
        norm=LossNorm.from_masks([t(mask)], max_len),
    )
    assert out.loss.dim() == 0 and torch.isfinite(out.loss)
    return out, logprobs


# ----------------------------------------------------------------------------- policy losses
@SETTINGS
@given(
    b=loss_batches(),
    eps=st.sampled_from([(0.2, 0.2), (0.2, 0.28), (0.1, 0.3)]),
    c=st.sampled_from([None, 1.5, 3.0]),
    agg=st.sampled_from(list(AGGREGATIONS)),
)
def test_ppo_matches_reference(b, eps, c, agg):
    lp, old, _roll, _ref, adv, _ent, mask = b
    cfg = AlgorithmConfig(eps_clip_low=eps[0], eps_clip_high=eps[1], dual_clip_c=c, loss_agg=agg)
    out, _ = loss_of(cfg, b, with_ref=False, with_ent=False)
    B, T = mask.shape
    per = np.zeros((B, T))
    clipped = np.zeros((B, T))
    for i in range(B):
        for j in range(T):
            per[i, j], clipped[i, j] = ref_ppo_token(lp[i, j], old[i, j], adv[i, j], eps[0], eps[1], c)
    want = ref_aggregate(agg, per, mask, 7)
    assert out.loss.item() == pytest.approx(want, rel=1e-9, abs=1e-12)
    n = mask.sum()
    assert out.metrics["clip_frac"] == pytest.approx((clipped * mask).sum() / n if n else 0.0, abs=1e-12)
    approx_kl = ((old - lp) * mask).sum() / n if n else 0.0
    assert out.metrics["approx_kl"] == pytest.approx(approx_kl, abs=1e-12)


def test_ppo_gradient_is_zero_where_clipped_and_dual_clip_caps():
    # token 0: A>0, ratio 1.5 > 1.2 → clipped, no grad. token 1: A>0 ratio 1 → grad -A·ratio.
    # token 2: A<0, ratio e^2 ≈ 7.39, c = 3 → loss capped at 3·|A| (dual clip), no grad.
    lp = torch.tensor([[math.log(1.5), 0.0, 2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 3, dtype=torch.float64)
    adv = torch.tensor([[1.0, 2.0, -0.5]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    algo = build_algorithm(AlgorithmConfig(dual_clip_c=3.0))
    out = algo.loss(lp, old, adv, mask, norm=LossNorm.from_masks([mask], 3))
    out.loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([0.0, -2.0 / 3, 0.0])
    assert out.loss.item() == pytest.approx((-1.2 - 2.0 + 1.5) / 3)
    assert out.metrics["dual_clip_frac"] == pytest.approx(1 / 3)
    assert out.metrics["clip_frac"] == pytest.approx(
        1 / 3
    )  # token 0 (for A<0, ρ>1+ε the unclipped branch wins)


@SETTINGS
@given(b=loss_batches(), eps=st.sampled_from([(3e-4, 4e-4), (0.05, 0.1), (0.5, 0.5)]))
def test_gspo_value_and_gradient_match_sequence_level_reference(b, eps):
    lp, old, roll, ref, adv, ent, mask = b
    adv = np.repeat(adv[:, :1], adv.shape[1], axis=1)  # GSPO: one advantage per sequence
    b = (lp, old, roll, ref, adv, ent, mask)
    cfg = AlgorithmConfig(policy_loss="gspo", gspo_eps_clip_low=eps[0], gspo_eps_clip_high=eps[1])
    out, logprobs = loss_of(cfg, b, with_ref=False, with_ent=False)
    assert build_algorithm(cfg).loss_agg == "seq_mean_token_mean"
    want = ref_aggregate("seq_mean_token_mean", ref_gspo(lp, old, adv, mask, *eps), mask, 7)
    assert out.loss.item() == pytest.approx(want, rel=1e-9, abs=1e-12)
    # gradient of the sequence-level objective (1/N_seq) Σ_i max(-A s_i, -A clip(s_i)), by autograd
    x = t(lp).requires_grad_(True)
    m = t(mask)
    s = torch.exp(((x - t(old)) * m).sum(-1) / m.sum(-1).clamp(min=1.0))
    a = t(adv)[:, 0]
    per_seq = torch.maximum(-a * s, -a * s.clamp(1 - eps[0], 1 + eps[1]))
    has = m.sum(-1) > 0
    ref_loss = (per_seq * has).sum() / max(int(has.sum()), 1)
    ref_loss.backward()
    out.loss.backward()
    np.testing.assert_allclose(logprobs.grad.numpy(), x.grad.numpy(), rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------------------- KL, entropy, TIS
@pytest.mark.parametrize("est", list(KL_ESTIMATORS))
@SETTINGS
@given(
    d=st.lists(
        st.one_of(st.floats(-30, 30, allow_nan=False), st.floats(-1e-6, 1e-6, allow_nan=False)),
        min_size=1,
        max_size=8,
    )
)
def test_kl_estimators_match_reference(est, d):
    got = KL_ESTIMATORS[est](t(d)).tolist()
    want = [ref_kl(est, x) for x in d]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    if est in ("k2", "k3", "low_var"):
        assert min(got) >= 0


@SETTINGS
@given(
    b=loss_batches(),
    est=st.sampled_from(list(KL_ESTIMATORS)),
    agg=st.sampled_from(list(AGGREGATIONS)),
    ent_coef=st.sampled_from([0.0, 0.01, -0.02]),
    tis=st.booleans(),
)
def test_total_loss_with_kl_entropy_tis_matches_reference(b, est, agg, ent_coef, tis):
    lp, old, roll, ref, adv, ent, mask = b
    cfg = AlgorithmConfig(
        kl_coef=0.1,
        use_kl_loss=True,
        kl_estimator=est,
        loss_agg=agg,
        entropy_coef=ent_coef,
        tis=tis,
        tis_cap=2.0,
        eps_clip_high=0.28,
    )
    out, _ = loss_of(cfg, b)
    B, T = mask.shape
    pg = np.zeros((B, T))
    kl = np.zeros((B, T))
    w = np.ones((B, T))
    for i in range(B):
        for j in range(T):
            pg[i, j], _ = ref_ppo_token(lp[i, j], old[i, j], adv[i, j], 0.2, 0.28, None)
            kl[i, j] = ref_kl(est, lp[i, j] - ref[i, j])
            if tis:
                w[i, j] = min(math.exp(old[i, j] - roll[i, j]), 2.0)
    want = (
        ref_aggregate(agg, pg * w, mask, 7)
        + 0.1 * ref_aggregate(agg, kl, mask, 7)
        - ent_coef * ref_aggregate(agg, ent, mask, 7)
    )
    assert out.loss.item() == pytest.approx(want, rel=1e-9, abs=1e-12)
    n = mask.sum()
    if n:
        assert out.metrics["logprob_mismatch"] == pytest.approx(np.abs(old - roll)[mask > 0].mean())
        assert out.metrics["kl"] == pytest.approx(kl[mask > 0].mean())
        assert out.metrics["entropy"] == pytest.approx(ent[mask > 0].mean())
        if tis:
            assert out.metrics["tis_weight_mean"] == pytest.approx(w[mask > 0].mean())


def test_tis_weight_is_detached_and_rollout_as_old_equals_passing_rollout():
    torch.manual_seed(1)
    lp = torch.randn(3, 4, dtype=torch.float64)
    old = lp + 0.1 * torch.randn(3, 4, dtype=torch.float64)
    roll = old + 0.3 * torch.randn(3, 4, dtype=torch.float64)
    adv = torch.randn(3, 4, dtype=torch.float64)
    mask = torch.ones(3, 4, dtype=torch.float64)
    norm = LossNorm.from_masks([mask], 4)

    x = lp.clone().requires_grad_(True)
    w = torch.exp(old - roll).clamp(max=2.0)
    build_algorithm(AlgorithmConfig(tis=True)).loss(
        x, old, adv, mask, rollout_logprobs=roll, norm=norm
    ).loss.backward()
    y = lp.clone().requires_grad_(True)
    build_algorithm(AlgorithmConfig()).loss(y, old, adv * w, mask, norm=norm).loss.backward()
    np.testing.assert_allclose(x.grad.numpy(), y.grad.numpy(), rtol=1e-12)  # w only scales, no grad of w

    as_old = build_algorithm(AlgorithmConfig(use_rollout_logprobs_as_old=True))
    assert not as_old.needs_old_logprobs and as_old.needs_rollout_logprobs
    a = as_old.loss(lp, None, adv, mask, rollout_logprobs=roll, norm=norm).loss
    b = build_algorithm(AlgorithmConfig()).loss(lp, roll, adv, mask, norm=norm).loss
    assert a.item() == pytest.approx(b.item(), rel=1e-12)


def test_missing_inputs_are_explained():
    x = torch.zeros(1, 2)
    norm = LossNorm.from_masks([torch.ones(1, 2)], 2)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        build_algorithm(AlgorithmConfig(tis=True)).loss(x, x, x, x + 1, norm=norm)
    with pytest.raises(ValueError, match="ref_logprobs"):
        build_algorithm(AlgorithmConfig(kl_coef=0.1, use_kl_loss=True)).loss(x, x, x, x + 1, norm=norm)
    with pytest.raises(ValueError, match="entropy"):
        build_algorithm(AlgorithmConfig(entropy_coef=0.1)).loss(x, x, x, x + 1, norm=norm)
    with pytest.raises(ValueError, match="shape"):
        build_algorithm(AlgorithmConfig()).loss(x, torch.zeros(2, 2), x, x + 1, norm=norm)


# ----------------------------------------------------------------------------- grad accumulation
@pytest.mark.parametrize("agg", list(AGGREGATIONS))
@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 7),
    T=st.integers(1, 6),
    cuts=st.lists(st.integers(1, 6), min_size=0, max_size=3),
    policy=st.sampled_from(["ppo", "gspo"]),
    seed=st.integers(0, 2**16),
)
def test_micro_batch_losses_sum_to_full_batch_loss(agg, B, T, cuts, policy, seed):
    """Σ micro-batch losses (global LossNorm) == full-batch loss, and so are the gradients."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = lp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = lp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    ent = torch.rand(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).to(torch.float64)
    cfg = AlgorithmConfig(policy_loss=policy, loss_agg=agg, kl_coef=0.1, use_kl_loss=True, entropy_coef=0.01)
    algo = build_algorithm(cfg)
    bounds = sorted({0, B, *[c for c in cuts if c < B]})
    slices = [slice(a, b) for a, b in itertools.pairwise(bounds)]
    norm = LossNorm.from_masks([mask[s] for s in slices], max_response_len=T + 2)
    assert norm == LossNorm.from_masks([mask], max_response_len=T + 2)

    full_x = lp.clone().requires_grad_(True)
    full = algo.loss(full_x, old, adv, mask, ref_logprobs=ref, entropy=ent, norm=norm).loss
    full.backward()
    micro_x = lp.clone().requires_grad_(True)
    total = 0.0
    for s in slices:
        out = algo.loss(micro_x[s], old[s], adv[s], mask[s], ref_logprobs=ref[s], entropy=ent[s], norm=norm)
        out.loss.backward()
        total += out.loss.item()
    assert total == pytest.approx(full.item(), rel=1e-10, abs=1e-12)
    np.testing.assert_allclose(micro_x.grad.numpy(), full_x.grad.numpy(), rtol=1e-10, atol=1e-13)


def test_loss_norm_counts_tokens_and_nonempty_sequences():
    m1 = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    m2 = torch.tensor([[1.0, 0.0, 1.0]])
    norm = LossNorm.from_masks([m1, m2], 16)
    assert norm == LossNorm(num_tokens=4.0, num_seqs=2.0, max_response_len=16)
    assert norm.all_reduced() == norm  # no process group: unchanged
    empty = LossNorm.from_masks([torch.zeros(2, 3)], 3)
    algo = build_algorithm(AlgorithmConfig())
    x = torch.zeros(2, 3, requires_grad=True)
    out = algo.loss(x, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), norm=empty)
    assert out.loss.item() == 0.0


def _all_reduce_worker(rank: int, store_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        masks = [torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])]
        norm = LossNorm.from_masks([masks[rank]], 3).all_reduced()
        torch.save((norm.num_tokens, norm.num_seqs, norm.max_response_len), f"{out_dir}/{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes re-import torch: ~10 s idle, far more on a loaded box
def test_loss_norm_all_reduced_over_two_gloo_ranks(tmp_path):
    """The step-global norm sums tokens / sequences over data-parallel ranks (real gloo, 2 processes)."""
    import torch.multiprocessing as mp

    mp.spawn(_all_reduce_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        assert torch.load(tmp_path / f"{rank}.pt") == (3.0, 2.0, 3)


def test_bf16_inputs_are_computed_in_float32_and_grads_flow_back():
    lp32 = torch.tensor([[-1.0, -2.0, -0.5]])
    lp = lp32.to(torch.bfloat16).requires_grad_(True)
    old = (lp32 + 0.05).to(torch.bfloat16)
    adv = torch.tensor([[1.0, -1.0, 0.5]])
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    algo = build_algorithm(AlgorithmConfig())
    out = algo.loss(lp, old, adv, mask, norm=LossNorm.from_masks([mask], 3))
    assert out.loss.dtype == torch.float32
    out.loss.backward()
    assert lp.grad is not None and lp.grad.dtype == torch.bfloat16 and lp.grad[0, 2] == 0
    ref = algo.loss(lp.detach().float(), old.float(), adv, mask.float(), norm=LossNorm.from_masks([mask], 3))
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-6)
