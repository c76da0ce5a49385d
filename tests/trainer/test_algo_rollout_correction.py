"""Rollout corrections against their formulas on hand-made ratios, their metrics, config and migration.

The references are plain Python over tokens, written from the formulas in docs/algorithms.md.
Edge cases: an empty mask (no loss tokens), a sequence whose every token is dropped, padding.
"""

from __future__ import annotations

import math

import pydantic
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.rollout.errors import ConfigError
from verst.trainer.algorithms import ROLLOUT_CORRECTIONS, AlgorithmConfig, LossNorm, build_algorithm
from verst.trainer.algorithms.rollout_correction import correction_metrics

torch.set_num_threads(1)
SETTINGS = settings(max_examples=40, deadline=None)


def ref_weights(kind: str, opts: dict, log_ratio: list[list[float]], mask: list[list[float]]):
    """Per-token weights from the formulas (Python floats)."""
    out = []
    for d_row, m_row in zip(log_ratio, mask, strict=True):
        on = [d for d, m in zip(d_row, m_row, strict=True) if m > 0]
        if kind in ("seq_tis", "mis_seq"):
            s = sum(on)
            if kind == "seq_tis" or opts.get("seq_ratio", "geometric") == "geometric":
                s = s / max(len(on), 1)
            seq = math.exp(min(max(s, -20), 20))
        row = []
        for d, m in zip(d_row, m_row, strict=True):
            r = math.exp(min(max(d, -20), 20))
            if m == 0:
                row.append(0.0)
            elif kind == "none":
                row.append(1.0)
            elif kind == "tis":
                row.append(min(r, opts.get("cap", 2.0)))
            elif kind == "seq_tis":
                row.append(min(seq, opts.get("cap", 2.0)))
            elif kind == "mis_token":
                keep = opts.get("lo", 0.5) <= r <= opts.get("hi", 2.0)
                row.append((r if opts.get("reweight", True) else 1.0) if keep else 0.0)
            elif kind == "mis_seq":
                keep = opts.get("lo", 0.5) <= seq <= opts.get("hi", 2.0)
                row.append((seq if opts.get("reweight", True) else 1.0) if keep else 0.0)
            elif kind == "icepop":
                keep = opts.get("alpha", 0.5) <= r <= opts.get("beta", 5.0)
                row.append(r if keep else 0.0)
        out.append(row)
    return out


CASES = [
    ("none", {}),
    ("tis", {}),
    ("tis", {"cap": 1.5}),
    ("seq_tis", {"cap": 1.2}),
    ("mis_token", {}),
    ("mis_token", {"lo": 0.8, "hi": 1.25, "reweight": False}),
    ("mis_seq", {}),
    ("mis_seq", {"lo": 0.9, "hi": 1.1, "seq_ratio": "product"}),
    ("mis_seq", {"lo": 0.9, "hi": 1.1, "reweight": False}),
    ("icepop", {}),
    ("icepop", {"alpha": 0.9, "beta": 1.1}),
]

# hand-made: row 0 mixes in-band and far-out ratios, row 1 is all far out (every token dropped by
# the band variants), row 2 is padding only (empty), row 3 is exactly on the band edges
HAND_LOG_RATIO = [
    [0.0, math.log(3.0), math.log(0.2), 0.05],
    [math.log(10.0), math.log(0.01), math.log(8.0), 0.0],
    [0.3, -0.3, 0.0, 0.0],
    [math.log(0.5), math.log(2.0), 0.0, 0.0],
]
HAND_MASK = [[1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]]


def _build(kind, opts):
    cfg = AlgorithmConfig(rollout_correction={"type": kind, **opts})
    return cfg.rollout_correction.build()


def test_every_variant_is_tested():
    assert {k for k, _ in CASES} == set(ROLLOUT_CORRECTIONS)


@pytest.mark.parametrize(("kind", "opts"), CASES)
def test_hand_made_ratios_match_formula(kind, opts):
    d = torch.tensor(HAND_LOG_RATIO, dtype=torch.float64)
    m = torch.tensor(HAND_MASK, dtype=torch.float64)
    w = _build(kind, opts)(d, m)
    assert torch.isfinite(w).all()
    assert torch.allclose(w, torch.tensor(ref_weights(kind, opts, HAND_LOG_RATIO, HAND_MASK), dtype=w.dtype))
    assert (w[2] == 0).all()  # the empty row stays 0


def test_hand_made_drops_where_expected():
    d = torch.tensor(HAND_LOG_RATIO, dtype=torch.float64)
    m = torch.tensor(HAND_MASK, dtype=torch.float64)
    w = _build("mis_token", {})(d, m)
    assert w[0].tolist() == pytest.approx([1.0, 0.0, 0.0, math.exp(0.05)])
    assert (w[1] == 0).all()  # every token outside [0.5, 2]
    assert w[3].tolist() == pytest.approx([0.5, 2.0, 0.0, 0.0])  # the band is closed
    metrics = correction_metrics(d, m, w)
    assert metrics["rc_masked_frac"].item() == pytest.approx(5 / 9)  # 2 of row 0, 3 of row 1
    assert metrics["rc_masked_seq_frac"].item() == pytest.approx(1 / 3)  # row 1 of 3 non-empty rows


def test_metrics_formulas_and_empty_mask():
    d = torch.tensor(HAND_LOG_RATIO, dtype=torch.float64)
    m = torch.tensor(HAND_MASK, dtype=torch.float64)
    w = _build("none", {})(d, m)
    met = {k: v.item() for k, v in correction_metrics(d, m, w).items()}
    on = [
        (x, 1)
        for row, mr in zip(HAND_LOG_RATIO, HAND_MASK, strict=True)
        for x, k in zip(row, mr, strict=True)
        if k
    ]
    ds = [x for x, _ in on]
    assert met["rc_kl_k1"] == pytest.approx(sum(-x for x in ds) / len(ds))
    assert met["rc_kl_k3"] == pytest.approx(sum(math.expm1(x) - x for x in ds) / len(ds))
    assert met["rc_ratio_max"] == pytest.approx(10.0)
    ratios = sorted(math.exp(x) for x in ds)
    assert met["rc_ratio_q50"] == pytest.approx(ratios[len(ratios) // 2])
    assert met["rc_masked_frac"] == 0.0 and met["rc_weight_mean"] == pytest.approx(1.0)
    # an empty mask: finite zeros / neutral values, no NaN
    empty = correction_metrics(d, torch.zeros_like(m), torch.zeros_like(m))
    assert all(math.isfinite(v.item()) for v in empty.values())
    assert empty["rc_masked_frac"].item() == 0.0 and empty["rc_masked_seq_frac"].item() == 0.0


@st.composite
def batches(draw):
    b = draw(st.integers(1, 4))
    t = draw(st.integers(1, 6))
    d = draw(st.lists(st.lists(st.floats(-3, 3), min_size=t, max_size=t), min_size=b, max_size=b))
    m = draw(st.lists(st.lists(st.sampled_from([0.0, 1.0]), min_size=t, max_size=t), min_size=b, max_size=b))
    return d, m


@SETTINGS
@given(batch=batches(), case=st.sampled_from(CASES))
def test_random_ratios_match_formula(batch, case):
    kind, opts = case
    d_list, m_list = batch
    d = torch.tensor(d_list, dtype=torch.float64)
    m = torch.tensor(m_list, dtype=torch.float64)
    w = _build(kind, opts)(d, m)
    ref = torch.tensor(ref_weights(kind, opts, d_list, m_list), dtype=torch.float64)
    assert torch.allclose(w, ref, rtol=1e-9, atol=1e-12)
    metrics = correction_metrics(d, m, w)
    assert all(math.isfinite(v.item()) for v in metrics.values())
    n = sum(map(sum, m_list))
    dropped = sum(
        1
        for wr, mr in zip(ref.tolist(), m_list, strict=True)
        for x, k in zip(wr, mr, strict=True)
        if k and x == 0
    )
    assert metrics["rc_masked_frac"].item() == pytest.approx(dropped / n if n else 0.0)


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize(("kind", "opts"), CASES)
def test_combines_with_every_policy_loss(policy_loss, kind, opts):
    """The algorithm's policy loss is the per-token loss times the correction's weight."""
    g = torch.Generator().manual_seed(0)
    shape = (4, 5)
    lp = (torch.randn(shape, generator=g) * 0.3 - 1).requires_grad_()
    old = lp.detach() + torch.randn(shape, generator=g) * 0.05
    rollout = old + torch.randn(shape, generator=g) * 0.8
    adv = torch.randn(shape, generator=g)
    mask = torch.ones(shape)
    mask[2] = 0  # an empty row
    mask[1, 3:] = 0  # padding
    norm = LossNorm.from_masks([mask], 5)
    base = build_algorithm(AlgorithmConfig(policy_loss=policy_loss, loss_agg="token_mean"))
    algo = build_algorithm(
        AlgorithmConfig(
            policy_loss=policy_loss, loss_agg="token_mean", rollout_correction={"type": kind, **opts}
        )
    )
    out = algo.loss(lp, old, adv, mask, rollout_logprobs=rollout, norm=norm)
    w = algo.config.rollout_correction.build()(old - rollout, mask)
    per_token = base.policy_loss(lp, old, adv, mask).loss
    expected = (per_token * w * mask).sum() / norm.num_tokens
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-7)
    assert "rc_masked_frac" in out.metrics and "rc_kl_k3" in out.metrics
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_no_rollout_logprobs_is_an_error_when_active():
    algo = build_algorithm(AlgorithmConfig(rollout_correction="icepop"))
    assert algo.needs_rollout_logprobs
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        algo.loss(x, x, x, x + 1, norm=LossNorm.from_masks([x + 1], 3))
    assert not build_algorithm(AlgorithmConfig()).needs_rollout_logprobs


def test_flat_tis_keys_migrate():
    cfg = AlgorithmConfig(tis=True, tis_cap=3.0)
    assert cfg.rollout_correction.type == "tis" and cfg.rollout_correction.cap == 3.0 and cfg.tis
    assert AlgorithmConfig(tis=False).rollout_correction.type == "none"
    assert (
        "rollout_correction" in AlgorithmConfig(tis=False).model_fields_set
    )  # explicit: fully-async keeps it
    assert AlgorithmConfig(tis_cap=5.0).rollout_correction.type == "none"  # ignored before, ignored now
    dumped = AlgorithmConfig(tis=True).model_dump()
    assert dumped["rollout_correction"] == {"type": "tis", "cap": 2.0} and "tis" not in dumped
    assert AlgorithmConfig.model_validate(dumped).tis
    with pytest.raises(pydantic.ValidationError):
        AlgorithmConfig(tis=True, tis_cap=-1.0)


def test_config_problems_name_the_keys():
    cfg = AlgorithmConfig(
        tis=True,
        rollout_correction={"type": "mis_token", "lo": 2.0, "hi": 1.0},
    )
    keys = [p.key for p in cfg.problems()]
    assert keys == ["algorithm.rollout_correction.lo", "algorithm.tis"]
    bad = [
        ({"type": "mis_seq", "lo": 1.5, "hi": 1.5}, "algorithm.rollout_correction.lo"),
        ({"type": "icepop", "alpha": 6.0}, "algorithm.rollout_correction.alpha"),
        ({"type": "tis_seq"}, "algorithm.rollout_correction"),
    ]
    for table, key in bad:
        with pytest.raises(ConfigError) as err:
            build_algorithm(AlgorithmConfig(rollout_correction=table))
        assert [p.key for p in err.value.problems] == [key]
        assert "seq_tis" in str(err.value) or "lo" in key or "alpha" in key
    with pytest.raises(ConfigError) as err:
        build_algorithm(AlgorithmConfig(rollout_correction="seq_tis", use_rollout_logprobs_as_old=True))
    assert [p.key for p in err.value.problems] == ["algorithm.rollout_correction"]
