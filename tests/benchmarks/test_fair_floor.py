"""The fair floor of `benchmarks/vs_trl*.py` computes the model's own function: its greedy decode
equals `generate`'s and its train log-probs equal the model's forward, with grouped-query
attention (6 heads over 2 KV heads, as the scale benchmark's SmolLM2 shape) and without; and its
gradient equals the one of the same loss through the model's forward."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from fair_floor import FairFloor, Rollout, check_against_hf, sample_rows


def _llama(heads: int, kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=40, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=8, max_position_embeddings=64, pad_token_id=0, eos_token_id=2,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


PROMPTS = [[1, 5, 9, 3], [1, 7, 7, 8, 11, 4, 6], [1, 30]]


@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (2, 2)])
def test_floor_decode_and_logprobs_equal_the_model(heads, kv_heads):
    model = _llama(heads, kv_heads)
    assert check_against_hf(model, PROMPTS, n=3, max_new=6, eos=2, pad=0) < 1e-4


RAGGED = [[[4, 2], [5, 6, 7]], [[8], [9, 10, 2]], [[3, 3, 3], [2]]]
DENSE = [[[4, 2, 9], [5, 6, 7]], [[8, 8, 1], [9, 10, 2]], [[3, 3, 3], [2, 5, 6]]]  # no padding in a group's grid  # fmt: skip


@pytest.mark.parametrize("responses", [RAGGED, DENSE], ids=["ragged", "dense"])
def test_floor_gradient_equals_the_models(responses):
    """Ragged answers go through the gathered grid; a group of equal-length answers (with one
    group a micro-batch) through its views, with the kept-logits LM head in both."""
    model = _llama(6, 2)
    ro = Rollout(PROMPTS, responses)
    adv = torch.tensor([1.0, -0.5, 0.25, 2.0, -1.0, 0.5])
    floor = FairFloor(model, lr=0.0, clip=1e9)  # no clipping, no step: the raw gradient
    floor.train(ro, adv, groups_per_micro=1)
    mine = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    terms, count = [], 0
    for g, (p, grp) in enumerate(zip(ro.prompts, ro.responses, strict=True)):
        for j, r in enumerate(grp):
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1]
            lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(r)[:, None])[:, 0]
            terms.append(adv[g * 2 + j] * lp.sum())
            count += len(r)
    (-(torch.stack(terms).sum()) / count).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(mine[k], p.grad, rtol=1e-4, atol=1e-6, msg=k)


def test_floor_sampler_draws_the_softmax_distribution():
    """`sample_rows` (inverse CDF, one uniform per draw) against `softmax(logits)`: a chi-square
    goodness-of-fit per row with a fixed seed, rows of very different shapes (one with a huge
    offset, which a plain `exp` would overflow), and zero-probability tokens never drawn."""
    torch.manual_seed(0)
    logits = torch.tensor(
        [
            [0.0, 1.0, 2.0, -1.0, 0.5, -0.5, 1.5, 0.2],
            [3.0, float("-inf"), 0.0, 0.0, float("-inf"), -2.0, 1.0, 0.0],
            [1000.0, 1001.0, 999.0, 1000.5, 998.0, 1002.0, 1000.0, 997.0],
        ]
    )
    draws = 40_000
    got = sample_rows(logits.clone(), draws).view(3, draws)
    probs = torch.softmax(logits.double(), -1)
    for row in range(3):
        counts = torch.bincount(got[row], minlength=8).double()
        assert counts[probs[row] == 0].sum() == 0, "a zero-probability token was drawn"
        seen = probs[row] > 0
        expected = probs[row][seen] * draws
        chi2 = ((counts[seen] - expected) ** 2 / expected).sum().item()
        # the 0.999 quantile of chi-square with 5 and 7 degrees of freedom: 20.52, 24.32
        assert chi2 < {5: 20.52, 7: 24.32}[int(seen.sum()) - 1], (row, chi2, counts, expected)


def test_floor_sampler_rows_and_draws_are_row_major():
    """Row r's draws come from row r's distribution (each row a point mass here)."""
    logits = torch.full((3, 5), float("-inf"))
    logits[0, 4], logits[1, 0], logits[2, 2] = 0.0, 0.0, 0.0
    assert sample_rows(logits, 3).tolist() == [4, 4, 4, 0, 0, 0, 2, 2, 2]
