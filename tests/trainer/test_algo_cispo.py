"""CISPO's gradient against its definition (MiniMax-M1):

    ∇L = −Σ_t m_t · sg(clip(ρ_t, 1 − ε_low, 1 + ε_high)) · A_t · ∇log π_θ(y_t) / N_tok

The reference builds that objective literally (``−clip(ρ).detach() · A · logp``) over a tiny
linear softmax policy and lets autograd differentiate it; verst's loss must give the same
parameter gradient, and the same gradient as the per-token formula through the log-probs.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.trainer.algorithms import AlgorithmConfig, LossNorm, build_algorithm

torch.set_num_threads(1)


def _policy(seed: int, b: int, t: int, v: int = 7, h: int = 5):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    hidden = torch.randn(b, t, h, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, v, (b, t), generator=g)

    def logprobs():
        return torch.log_softmax(hidden @ weight.T, -1).gather(-1, tokens[..., None])[..., 0]  # [b, t]

    return weight, logprobs, g


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 3),
    t=st.integers(1, 5),
    eps_low=st.sampled_from([1.0, 0.2]),
    eps_high=st.sampled_from([0.28, 0.05, 2.0]),
)
def test_cispo_gradient_matches_definition(seed, b, t, eps_low, eps_high):
    weight, logprobs, g = _policy(seed, b, t)
    with torch.no_grad():
        old = logprobs() + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) > 0.3).to(torch.float64)
    norm = LossNorm.from_masks([mask], t)
    algo = build_algorithm(
        AlgorithmConfig(
            policy_loss={"type": "cispo", "eps_clip_low": eps_low, "eps_clip_high": eps_high},
            loss_agg="token_mean",
        )
    )

    lp = logprobs()
    out = algo.loss(lp, old, adv, mask, norm=norm)
    (grad_verst,) = torch.autograd.grad(out.loss, weight)

    lp_ref = logprobs()
    w = torch.exp(lp_ref - old).clamp(1 - eps_low, 1 + eps_high).detach()
    objective = -(w * adv * lp_ref * mask).sum() / max(norm.num_tokens, 1.0)
    (grad_ref,) = torch.autograd.grad(objective, weight)
    assert torch.allclose(grad_verst, grad_ref, rtol=1e-10, atol=1e-12)

    # per token: dL/dlogp_t = −m_t clip(ρ_t) A_t / N, nonzero also where ρ is clipped (PPO: zero)
    lp_leaf = lp.detach().requires_grad_()
    (g_tok,) = torch.autograd.grad(algo.loss(lp_leaf, old, adv, mask, norm=norm).loss, lp_leaf)
    assert torch.allclose(g_tok, -(w * adv * mask) / max(norm.num_tokens, 1.0), rtol=1e-10, atol=1e-14)
    assert out.loss.item() == pytest.approx((-(w * adv * mask).sum() / max(norm.num_tokens, 1.0)).item())


def test_clipped_tokens_keep_their_gradient_unlike_ppo():
    lp = torch.tensor([[0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0, 0.0]], dtype=torch.float64)  # ρ = e ≈ 2.72 (clipped), 1
    adv = torch.ones(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    norm = LossNorm.from_masks([mask], 2)
    grads = {}
    for name in ("cispo", "ppo"):
        out = build_algorithm(AlgorithmConfig(policy_loss=name, loss_agg="token_mean")).loss(
            lp, old, adv, mask, norm=norm
        )
        (grads[name],) = torch.autograd.grad(out.loss, lp)
        assert out.metrics["clip_frac"] == pytest.approx(0.5)
    assert grads["ppo"][0, 0] == 0.0  # PPO: the clipped branch has no gradient
    assert grads["cispo"][0, 0].item() == pytest.approx(-1.28 / 2)  # CISPO: clip(ρ) = 1.28
    assert grads["cispo"][0, 1].item() == pytest.approx(-1.0 / 2)
