"""`train.exact_on_policy` in the embedded engine's split layout of shared prompts: a group's
prompt KV kept once (`shared_prefix.PrefixKV`), each row's own tokens in its own cache, new waves
of rows admitted between steps (their own caches then start with masked holes). Every sampled
token's log-prob equals the trainer's exact path over the same tokens bit for bit, and the same
rows in the flat layout give the same bits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded.batch import DecodeBatch, Row
from verst.rollout.engines.embedded.exact import enable_exact
from verst.rollout.engines.embedded.sampling import RowSampling

MODEL = Path(__file__).resolve().parents[2] / "examples" / "reverse_digits" / "model" / "warm_start"

WAVES = [  # admitted before step 0, 2 and 5: (prompt kind, prompt length, max new, seed)
    [(0, 9, 6, 1), (0, 9, 3, 2), (0, 9, 8, 3), (1, 5, 1, 4), (1, 5, 7, 5)],
    [(2, 14, 5, 6), (2, 14, 5, 7), (3, 4, 4, 8)],
    [(0, 9, 3, 9), (0, 9, 6, 10), (4, 20, 2, 11), (4, 20, 1, 12)],
]


def _row(kind: int, length: int, max_new: int, seed: int) -> Row:
    ids = [1] + [4 + (kind * 7 + j * 5) % 14 for j in range(length - 1)]
    req = GenerateRequest(
        ids,
        SamplingParams(max_new, temperature=1.0, ignore_eos=True, sampling_seed=seed),
        return_logprob=True,
        rid=f"{kind}-{seed}",
    )
    return Row(req, RowSampling(1.0, 1.0, -1, seed), frozenset(), 256)


def _model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()


def _run_waves(share_decode: bool) -> tuple[list[Row], list[bool]]:
    batch = DecodeBatch(_model(), 0, None)
    enable_exact(batch)
    batch.share_decode = share_decode
    rows, split, step = [], [], 0
    with torch.inference_mode():
        while step == 0 or len(batch):
            wave = {0: 0, 2: 1, 5: 2}.get(step)
            if wave is not None:
                new = [_row(*spec) for spec in WAVES[wave]]
                rows += new
                batch.admit(new)
                split.append(batch.prefix is not None)
                batch.pop_finished()
            if len(batch):
                batch.step()
                batch.pop_finished()
            step += 1
    return rows, split


@pytest.fixture(scope="module")
def trainer():
    from verst.rollout.exact_model import install_exact

    model = _model()
    install_exact(model)
    return model


def _trainer_logprobs(model, rows: list[Row]) -> torch.Tensor:
    from verst.trainer.train.logprobs import PolicyLogprobs, pack_sequences

    tokens = [list(r.request.input_ids) + list(r.output_ids) for r in rows]
    with torch.no_grad():
        inputs = pack_sequences(tokens, [len(r.output_ids) for r in rows], layout="padded")
        return PolicyLogprobs(model, backend="exact")(inputs)[0]


def test_split_layout_logprobs_equal_the_trainers_bit_for_bit(trainer):
    torch.set_num_threads(2)
    rows, split = _run_waves(share_decode=True)
    assert split == [True, True, True]  # every wave decoded in the split layout
    engine = torch.tensor([x for r in rows for x in r.output_logprobs])
    mine = _trainer_logprobs(trainer, rows)
    assert engine.numel() == sum(s[2] for w in WAVES for s in w)
    assert int((engine != mine).sum()) == 0
    flat_rows, flat = _run_waves(share_decode=False)
    assert flat == [False, False, False]
    for a, b in zip(rows, flat_rows, strict=True):
        assert a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs
