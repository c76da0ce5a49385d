"""Advantage estimators against straightforward float64 loop references (hypothesis).

The references below are written independently of `verst.trainer.algorithms`: plain Python loops
over groups / samples / tokens, in float64, from the formulas in docs/algorithms.md.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.trainer.algorithms import ADVANTAGE_ESTIMATORS, AlgorithmConfig, build_algorithm

torch.set_num_threads(1)
SETTINGS = settings(max_examples=60, deadline=None)
# the estimators that work from rewards alone (GAE needs a critic's values: tests/trainer/test_algo_gae.py)
GROUP_ESTIMATORS = [name for name, cls in ADVANTAGE_ESTIMATORS.items() if not cls.needs_values]


# ----------------------------------------------------------------------------- references
def ref_kl(name: str, d: float) -> float:
    """KL estimator of the log-ratio d = logp - logp_ref."""
    if name == "k1":
        return d
    if name == "k2":
        return 0.5 * d * d
    if name == "k3":
        return math.exp(-d) + d - 1.0
    x = min(max(-d, -20.0), 20.0)
    return min(max(math.exp(x) - x - 1.0, -10.0), 10.0)


def ref_scores(rewards, mask, kl, kl_coef, est):
    """s_i = r_i - kl_coef * sum_t mask_it * KL(kl_it), as a flat list over samples."""
    G, n = rewards.shape
    out = []
    for i in range(G * n):
        s = float(rewards[i // n, i % n])
        if kl is not None:
            s -= sum(kl_coef * ref_kl(est, float(kl[i, t])) * float(mask[i, t]) for t in range(mask.shape[1]))
        out.append(s)
    return out


def ref_group_adv(rewards, mask, kl, kl_coef, est, kind: str, normalize_std: bool = True):
    G, n = rewards.shape
    s = ref_scores(rewards, mask, kl, kl_coef, est)
    adv = np.zeros(mask.shape)
    for g in range(G):
        grp = s[g * n : (g + 1) * n]
        mean = sum(grp) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (n - 1)) if n > 1 else 0.0
        for j in range(n):
            if kind == "grpo":
                a = (grp[j] - mean) / (std + 1e-6) if normalize_std else grp[j] - mean
            elif kind == "dr_grpo":
                a = grp[j] - mean
            elif kind == "rloo":
                a = grp[j] - sum(grp[k] for k in range(n) if k != j) / (n - 1) if n > 1 else 0.0
            elif kind == "reinforce_pp_baseline":
                a = grp[j] - mean
            for t in range(mask.shape[1]):
                adv[g * n + j, t] = a * mask[g * n + j, t]
    if kind == "reinforce_pp_baseline":
        adv = ref_whiten(adv, mask)
    return adv


def ref_whiten(values, mask):
    picked = [values[i, t] for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t] > 0]
    k = len(picked)
    out = np.zeros(values.shape)
    if k == 0:
        return out
    mean = sum(picked) / k
    var = sum((x - mean) ** 2 for x in picked) / (k - 1) if k > 1 else 0.0
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t] > 0:
                out[i, t] = (values[i, t] - mean) / math.sqrt(var + 1e-8)
    return out


def ref_reinforce_pp(rewards, mask, kl, kl_coef, est, gamma):
    n = rewards.shape[1]
    B, T = mask.shape
    returns = np.zeros((B, T))
    for i in range(B):
        valid = [t for t in range(T) if mask[i, t] > 0]
        rho = [0.0] * T
        if valid:
            rho[valid[-1]] = float(rewards[i // n, i % n])
        if kl is not None:
            for t in range(T):
                rho[t] -= kl_coef * ref_kl(est, float(kl[i, t])) * float(mask[i, t])
        for t in range(T):
            returns[i, t] = sum(gamma ** (u - t) * rho[u] for u in range(t, T))
    return ref_whiten(returns, mask)


# ----------------------------------------------------------------------------- strategies
reward_values = st.one_of(
    st.sampled_from([0.0, 0.5, 1.0, -1.0]),
    st.floats(-5, 5, allow_nan=False, width=32),
)


@st.composite
def batches(draw, with_kl: bool | None = None):
    G = draw(st.integers(1, 3))
    n = draw(st.integers(1, 4))
    T = draw(st.integers(1, 6))
    rewards = np.array(draw(st.lists(reward_values, min_size=G * n, max_size=G * n)), dtype=np.float32)
    rewards = rewards.reshape(G, n)
    # masks: padded responses (a prefix of ones) or arbitrary 0/1 patterns (multi-turn loss masks)
    if draw(st.booleans()):
        lengths = draw(st.lists(st.integers(0, T), min_size=G * n, max_size=G * n))
        mask = np.array([[1.0 if t < L else 0.0 for t in range(T)] for L in lengths], dtype=np.float32)
    else:
        bits = draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=G * n * T, max_size=G * n * T))
        mask = np.array(bits, dtype=np.float32).reshape(G * n, T)
    use_kl = draw(st.booleans()) if with_kl is None else with_kl
    kl = None
    if use_kl:
        vals = draw(
            st.lists(st.floats(-2, 2, allow_nan=False, width=32), min_size=G * n * T, max_size=G * n * T)
        )
        kl = np.array(vals, dtype=np.float32).reshape(G * n, T)
    return rewards, mask, kl


def run(cfg: AlgorithmConfig, rewards, mask, kl):
    algo = build_algorithm(cfg)
    out = algo.compute_advantages(
        torch.from_numpy(rewards), torch.from_numpy(mask), None if kl is None else torch.from_numpy(kl)
    )
    assert out.dtype == torch.float32 and out.shape == mask.shape
    assert torch.isfinite(out).all()
    assert (out[torch.from_numpy(mask) == 0] == 0).all(), "advantage must be 0 off the response mask"
    return out.double().numpy()


def kl_cfg(kl, est="k3"):
    if kl is None:
        return {}
    return {"kl_coef": 0.05, "use_kl_in_reward": True, "kl_estimator": est}


def close(got, want, tol=2e-5):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("normalize_std", [True, False])
@SETTINGS
@given(b=batches(), est=st.sampled_from(["k1", "k2", "k3", "low_var"]))
def test_grpo_matches_reference(normalize_std, b, est):
    rewards, mask, kl = b
    got = run(
        AlgorithmConfig(advantage="grpo", normalize_std=normalize_std, **kl_cfg(kl, est)), rewards, mask, kl
    )
    close(got, ref_group_adv(rewards, mask, kl, 0.05, est, "grpo", normalize_std))


@pytest.mark.parametrize("kind", ["dr_grpo", "rloo", "reinforce_pp_baseline"])
@SETTINGS
@given(b=batches())
def test_group_estimators_match_reference(kind, b):
    rewards, mask, kl = b
    got = run(AlgorithmConfig(advantage=kind, **kl_cfg(kl)), rewards, mask, kl)
    close(got, ref_group_adv(rewards, mask, kl, 0.05, "k3", kind), tol=1e-4)


@SETTINGS
@given(b=batches(), gamma=st.sampled_from([1.0, 0.9, 0.5]), est=st.sampled_from(["k1", "k2", "low_var"]))
def test_reinforce_pp_matches_reference(b, gamma, est):
    rewards, mask, kl = b
    cfg = AlgorithmConfig(advantage="reinforce_pp", gamma=gamma, **kl_cfg(kl, est))
    got = run(cfg, rewards, mask, kl)
    close(got, ref_reinforce_pp(rewards, mask, kl, 0.05, est, gamma), tol=1e-4)


@pytest.mark.parametrize("kind", GROUP_ESTIMATORS)
@SETTINGS
@given(
    G=st.integers(1, 4),
    n=st.integers(1, 5),
    T=st.integers(1, 5),
    value=st.floats(-10, 10, allow_nan=False, width=32),
)
def test_all_equal_rewards_give_exactly_zero(kind, G, n, T, value):
    """Equal rewards in every group → zero advantage, exactly, for every estimator (no NaN)."""
    rewards = np.full((G, n), value, dtype=np.float32)
    mask = np.ones((G * n, T), dtype=np.float32)
    mask[0, T // 2 :] = 0  # ragged
    # (reinforce_pp: with gamma = 1 the return-to-go of an equal reward is equal on every token)
    got = run(AlgorithmConfig(advantage=kind), rewards, mask, None)
    assert np.all(got == 0), got


@pytest.mark.parametrize("kind", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_single_sample_groups_give_zero(kind):
    rewards = torch.tensor([[1.0], [0.0], [3.0]])
    mask = torch.ones(3, 4)
    out = build_algorithm(AlgorithmConfig(advantage=kind)).compute_advantages(rewards, mask)
    assert torch.equal(out, torch.zeros(3, 4))


def test_reinforce_pp_single_sample_groups_still_learn():
    """REINFORCE++ has no group baseline: single-sample groups get whitened, non-zero advantages."""
    rewards = torch.tensor([[1.0], [0.0]])
    mask = torch.ones(2, 3)
    out = build_algorithm(AlgorithmConfig(advantage="reinforce_pp")).compute_advantages(rewards, mask)
    assert (out[0] > 0).all() and (out[1] < 0).all()


def test_empty_mask_rows_and_fully_empty_batch():
    for kind in GROUP_ESTIMATORS:
        algo = build_algorithm(AlgorithmConfig(advantage=kind))
        out = algo.compute_advantages(torch.tensor([[1.0, 0.0]]), torch.zeros(2, 3))
        assert torch.equal(out, torch.zeros(2, 3)), kind


def test_grpo_known_values():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    out = build_algorithm(AlgorithmConfig()).compute_advantages(rewards, torch.ones(4, 2))
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    assert out[0, 0].item() == pytest.approx(0.5 / (std + 1e-6), rel=1e-6)
    assert out[1, 1].item() == pytest.approx(-0.5 / (std + 1e-6), rel=1e-6)


def test_kl_in_reward_requires_kl():
    algo = build_algorithm(AlgorithmConfig(kl_coef=0.1, use_kl_in_reward=True))
    assert algo.needs_reference and algo.needs_kl_in_reward
    with pytest.raises(ValueError, match="pass kl"):
        algo.compute_advantages(torch.zeros(1, 2), torch.ones(2, 3))


def test_shape_errors_are_explained():
    algo = build_algorithm(AlgorithmConfig())
    with pytest.raises(ValueError, match="num_groups"):
        algo.compute_advantages(torch.zeros(4), torch.ones(4, 3))
    with pytest.raises(ValueError, match="response_mask"):
        algo.compute_advantages(torch.zeros(2, 2), torch.ones(3, 3))
