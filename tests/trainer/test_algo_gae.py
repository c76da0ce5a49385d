"""GAE(γ, λ) against a plain reference, the value loss against its formula, critic config problems.

The GAE reference is the textbook loop over each sample's *model tokens* (the masked positions,
compressed into a list: tool / observation tokens and padding are not states), written from
docs/algorithms.md, independent of `verst.trainer.algorithms`.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.rollout.errors import ConfigError
from verst.trainer.algorithms import AlgorithmConfig, LossNorm, build_algorithm
from verst.trainer.algorithms.value_loss import explained_variance, value_loss

torch.set_num_threads(1)


def ref_gae(reward: float, values: list[float], mask: list[float], penalty: list[float], gamma, lam):
    """Per position advantages and returns (0 off the mask), from the compressed model tokens."""
    idx = [t for t, m in enumerate(mask) if m > 0]
    adv = [0.0] * len(mask)
    ret = [0.0] * len(mask)
    running = 0.0
    for k in range(len(idx) - 1, -1, -1):
        t = idx[k]
        r = (reward if k == len(idx) - 1 else 0.0) - penalty[t]
        next_v = values[idx[k + 1]] if k + 1 < len(idx) else 0.0
        delta = r + gamma * next_v - values[t]
        running = delta + gamma * lam * running
        adv[t] = running
        ret[t] = running + values[t]
    return adv, ret


def ref_whiten(adv, mask):
    picked = [a for row, mr in zip(adv, mask, strict=True) for a, m in zip(row, mr, strict=True) if m > 0]
    n = len(picked)
    if n == 0:
        return adv
    mean = sum(picked) / n
    var = sum((x - mean) ** 2 for x in picked) / (n - 1) if n > 1 else 0.0
    return [
        [(a - mean) / math.sqrt(var + 1e-8) if m > 0 else 0.0 for a, m in zip(row, mr, strict=True)]
        for row, mr in zip(adv, mask, strict=True)
    ]


@st.composite
def gae_batches(draw):
    g = draw(st.integers(1, 3))
    n = draw(st.integers(1, 3))
    t = draw(st.integers(1, 7))
    b = g * n
    masks = []
    for _ in range(b):  # right padding after a response, with holes (tool tokens) inside
        length = draw(st.integers(0, t))
        holes = draw(st.lists(st.booleans(), min_size=length, max_size=length))
        masks.append([0.0 if h else 1.0 for h in holes] + [0.0] * (t - length))
    floats = st.floats(-2, 2, allow_nan=False)
    values = draw(st.lists(st.lists(floats, min_size=t, max_size=t), min_size=b, max_size=b))
    rewards = draw(st.lists(floats, min_size=b, max_size=b))
    return g, n, rewards, values, masks


@settings(max_examples=40, deadline=None)
@given(
    batch=gae_batches(),
    gamma=st.sampled_from([1.0, 0.99, 0.5]),
    lam=st.sampled_from([1.0, 0.95, 0.0, 0.3]),
    whiten=st.booleans(),
)
def test_gae_matches_reference(batch, gamma, lam, whiten):
    g, n, rewards, values, masks = batch
    algo = build_algorithm(
        AlgorithmConfig(advantage={"type": "gae", "gamma": gamma, "lam": lam, "whiten": whiten}, critic={})
    )
    assert algo.needs_values
    r = torch.tensor(rewards, dtype=torch.float64).reshape(g, n)
    m = torch.tensor(masks)
    v = torch.tensor(values)
    adv, ret = algo.compute_advantages_and_returns(r, m, values=v)
    ref = [
        ref_gae(rw, vs, ms, [0.0] * len(ms), gamma, lam)
        for rw, vs, ms in zip(rewards, values, masks, strict=True)
    ]
    ref_adv = [a for a, _ in ref]
    if whiten:
        ref_adv = ref_whiten(ref_adv, masks)
    assert torch.allclose(adv.double(), torch.tensor(ref_adv, dtype=torch.float64), atol=2e-5, rtol=1e-5)
    assert torch.allclose(ret.double(), torch.tensor([x for _, x in ref], dtype=torch.float64), atol=1e-5)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[m == 0] == 0).all() and (ret[m == 0] == 0).all()  # only model tokens


def test_gae_with_kl_penalty_in_reward_and_lambda_one_is_return_minus_value():
    algo = build_algorithm(
        AlgorithmConfig(
            advantage={"type": "gae", "gamma": 1.0, "lam": 1.0, "whiten": False},
            critic={},
            kl_coef=0.5,
            use_kl_in_reward=True,
            kl_estimator="k1",
        )
    )
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])  # a tool token at t=1
    kl = torch.tensor([[0.2, 9.0, -0.4, 0.1]])
    values = torch.tensor([[0.3, 5.0, -0.1, 0.7]])
    adv, ret = algo.compute_advantages_and_returns(torch.tensor([[2.0]]), mask, kl=kl, values=values)
    pen = [0.1, 0.0, -0.2, 0.05]  # kl_coef * k1, masked
    go = [2.0 - 0.05 + 0.2 - 0.1, 0.0, 2.0 - 0.05 + 0.2, 2.0 - 0.05]  # reward-to-go over model tokens
    assert ret[0].tolist() == pytest.approx(go)
    assert adv[0].tolist() == pytest.approx([go[0] - 0.3, 0.0, go[2] + 0.1, go[3] - 0.7])
    ref_adv, _ = ref_gae(2.0, values[0].tolist(), mask[0].tolist(), pen, 1.0, 1.0)
    assert adv[0].tolist() == pytest.approx(ref_adv)


def test_gae_without_values_is_an_error():
    algo = build_algorithm(AlgorithmConfig(advantage="gae", critic={}))
    with pytest.raises(ValueError, match="values"):
        algo.compute_advantages(torch.zeros(1, 2), torch.ones(2, 3))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 1000),
    clip=st.sampled_from([None, 0.2, 0.05]),
)
def test_value_loss_matches_formula_and_gradient(seed, clip):
    g = torch.Generator().manual_seed(seed)
    shape = (3, 4)
    v = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    old = v.detach() + torch.randn(shape, generator=g, dtype=torch.float64) * 0.3
    ret = torch.randn(shape, generator=g, dtype=torch.float64)
    mask = (torch.rand(shape, generator=g) > 0.3).double()
    norm = LossNorm.from_masks([mask], 4)
    out = value_loss(v, old, ret, mask, norm, clip)
    total = 0.0
    for i in range(3):
        for t in range(4):
            if mask[i, t] == 0:
                continue
            a, o, r = float(v.detach()[i, t]), float(old[i, t]), float(ret[i, t])
            e = (a - r) ** 2
            if clip is not None:
                vc = o + min(max(a - o, -clip), clip)
                e = max(e, (vc - r) ** 2)
            total += 0.5 * e
    assert out.loss.item() == pytest.approx(total / max(norm.num_tokens, 1.0))
    (grad,) = torch.autograd.grad(out.loss, v)
    assert (grad[mask == 0] == 0).all()
    assert all(math.isfinite(float(x)) for x in out.metrics.values())


def test_explained_variance():
    ret = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones(1, 4)
    assert explained_variance(ret, ret, mask) == pytest.approx(1.0)
    assert explained_variance(torch.zeros(1, 4), ret, mask) == pytest.approx(0.0)
    assert explained_variance(ret, ret, torch.zeros(1, 4)) == 0.0


def test_critic_config_problems_name_the_keys():
    cases = [
        ({"advantage": "grpo", "critic": {}}, ["algorithm.critic"]),
        ({"advantage": "rloo", "critic": {"lr": 1e-4}}, ["algorithm.critic"]),
        ({"advantage": "gae"}, ["algorithm.advantage"]),
        (
            {"advantage": "gae", "rollout_correction": {"type": "mis_seq", "lo": 3.0, "hi": 2.0}},
            ["algorithm.rollout_correction.lo", "algorithm.advantage"],
        ),
    ]
    for data, keys in cases:
        with pytest.raises(ConfigError) as err:
            build_algorithm(AlgorithmConfig(**data))
        assert [p.key for p in err.value.problems] == keys, data
        assert "critic" in str(err.value)
    build_algorithm(AlgorithmConfig(advantage="gae", critic={"value_clip": None, "warmup_steps": 2}))


def test_critic_table_from_toml():
    import tomllib

    text = """
    advantage = { type = "gae", gamma = 1.0, lam = 0.9 }
    [critic]
    lr = 5e-4
    value_clip = 0.5
    warmup_steps = 3
    """
    cfg = AlgorithmConfig.model_validate(tomllib.loads(text))
    assert cfg.critic is not None and cfg.critic.lr == 5e-4 and cfg.critic.warmup_steps == 3
    assert cfg.advantage.lam == 0.9
    assert AlgorithmConfig.model_validate(cfg.model_dump()).critic == cfg.critic
