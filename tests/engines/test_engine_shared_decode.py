"""The embedded engine's split decode layout (`engines/embedded/shared_prefix.py`): a shared
prompt's KV kept once per group, each row's own tokens in its own cache, attended by
`attention.TwoPartAttention`.

Pinned here: the two-part attention is SDPA's over `[the group's prompt ; the row's own keys]`
for any grouping of slots (the slots the grid in order, or scattered), padding and head ratio;
the layout's grid round-trips; `PrefixKV` merges and drops groups and columns; a decode batch in
the split layout produces the flat layout's tokens (seeded sampling and greedy) and log-probs
through continuous batching (groups merging between steps, rows finishing at different steps,
compaction, a group of one, rows finishing before their first step); and the layout is only
used where it serves (shared prompts, on CPU, with the direct step).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded.attention import TwoPartAttention
from verst.rollout.engines.embedded.batch import DecodeBatch, Row
from verst.rollout.engines.embedded.sampling import RowSampling
from verst.rollout.engines.embedded.shared_prefix import GroupLayout, PrefixKV

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()


def _bias(attend: torch.Tensor) -> torch.Tensor:
    return torch.zeros(attend.shape).masked_fill_(~attend, float("-inf"))


@settings(max_examples=40, deadline=None)
@given(
    heads_kv=st.sampled_from([(4, 4), (4, 2), (6, 3), (4, 1)]),
    group=st.lists(st.integers(0, 3), min_size=1, max_size=9),
    widths=st.tuples(st.integers(1, 20), st.integers(1, 12)),
    seed=st.integers(0, 10_000),
)
def test_two_part_attention_equals_sdpa(heads_kv, group, widths, seed):
    """Each slot attends to its group's prompt (left padding per group) then its own keys (left
    padding per slot, its last column always real): SDPA over the concatenation, repeated heads."""
    heads, kv = heads_kv
    (width, own), d, b = widths, 8, len(group)
    groups = max(group) + 1
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, 1, d, generator=g)
    pk, pv = torch.randn(2, groups, kv, width, d, generator=g)
    k, v = torch.randn(2, b, kv, own, d, generator=g)
    pmask = (torch.arange(width) >= torch.randint(0, width, (groups, 1), generator=g)).long()  # [G, P]
    attend = torch.rand(b, own, generator=g) < 0.6
    attend[:, -1] = True
    prefix = PrefixKV([pk], [pv], pmask, torch.tensor(group))
    bias = torch.cat([prefix.bias, _bias(attend[:, None, None, :])], dim=-1)  # [b, 1, 1, P + L]
    got = TwoPartAttention()(q, (pk, pv, prefix.layout), k, v, bias, 0.3)  # [b, 1, heads, d]
    index = torch.tensor(group)
    keys, values = torch.cat([pk[index], k], dim=2), torch.cat([pv[index], v], dim=2)  # [b, kv, P + L, d]
    mask = torch.cat([pmask[index].bool(), attend], dim=1)[:, None, None, :]
    rep = heads // kv
    want = F.scaled_dot_product_attention(
        q, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1), attn_mask=mask, scale=0.3
    )
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("group", "dense"),
    [([0, 0, 1, 1], True), ([0, 1, 0, 1], False), ([0, 0, 0, 1], False), ([2, 1, 0], False), ([0], True)],
)
def test_layout_grid_round_trips(group, dense):
    layout = GroupLayout.of(torch.tensor(group), max(group) + 1)
    assert (layout.place is None) == dense
    x = torch.randn(len(group), 2, 3, 5)  # [slots, kv, rep, c]
    grid = layout.to_grid(x)
    assert grid.shape == (max(group) + 1, 2, layout.size * 3, 5)
    torch.testing.assert_close(layout.to_slots(grid), x, rtol=0, atol=0)
    y = torch.randn(len(group), 2, 3, 4)
    torch.testing.assert_close(layout.join(grid, y), torch.cat([x, y], dim=-1), rtol=0, atol=0)


def test_prefix_merge_and_select():
    keys = torch.arange(2 * 1 * 3 * 1, dtype=torch.float32).view(2, 1, 3, 1)
    a = PrefixKV([keys], [keys + 100], torch.tensor([[0, 1, 1], [1, 1, 1]]), torch.tensor([0, 0, 1]))
    b = PrefixKV(
        [torch.ones(1, 1, 2, 1)], [torch.ones(1, 1, 2, 1)], torch.tensor([[1, 1]]), torch.tensor([0])
    )
    merged = a.merge(b)
    assert merged.mask.tolist() == [[0, 1, 1], [1, 1, 1], [0, 1, 1]]
    assert merged.group.tolist() == [0, 0, 1, 2]
    assert merged.keys[0][2, 0, :, 0].tolist() == [0.0, 1.0, 1.0]  # padded on the left with zeros
    kept = merged.select(torch.tensor([0, 3]))  # group 1 goes; column 0 is padding for both left
    assert kept.group.tolist() == [0, 1] and kept.mask.tolist() == [[1, 1], [1, 1]]
    assert kept.keys[0][:, 0, :, 0].tolist() == [[1.0, 2.0], [1.0, 1.0]]
    assert kept.bias.shape == (2, 1, 1, 2) and kept.layout.place is None


def prompt_ids(kind: int, length: int) -> list[int]:
    return [1] + [4 + (kind * 13 + j * 5) % 50 for j in range(length - 1)]


def make_row(kind: int, length: int, max_new: int, seed: int | None, temperature: float = 1.0) -> Row:
    req = GenerateRequest(
        prompt_ids(kind, length),
        SamplingParams(max_new, temperature=temperature, ignore_eos=True, sampling_seed=seed),
        return_logprob=True,
        rid=f"{kind}-{seed}",
    )
    return Row(req, RowSampling(temperature, 1.0, -1, seed), frozenset(), 256)


WAVES = [  # admitted before step 0, 2 and 5: (prompt kind, prompt length, max new, seed, temperature)
    [(0, 9, 6, 1, 1.0), (0, 9, 3, 2, 1.0), (0, 9, 8, 3, 0.0), (1, 5, 1, 4, 1.0), (1, 5, 7, 5, 0.7)],
    [(2, 14, 5, 6, 1.0), (2, 14, 5, 7, 1.0), (3, 4, 4, 8, 0.0)],  # a group of one among them
    [(0, 9, 3, 9, 1.0), (0, 9, 6, 10, 1.0), (4, 20, 2, 11, 1.0), (4, 20, 1, 12, 1.0)],
]


def run_waves(model, share_decode: bool) -> tuple[list[Row], list[bool]]:
    """Admit `WAVES` between steps, decode to the end; → every row, and whether each wave's
    batch was split."""
    batch = DecodeBatch(model, 0, None)
    batch.share_decode = share_decode
    rows, split, step = [], [], 0
    with torch.inference_mode():
        while step == 0 or len(batch):
            wave = {0: 0, 2: 1, 5: 2}.get(step)
            if wave is not None:
                new = [make_row(*spec) for spec in WAVES[wave]]
                rows += new
                batch.admit(new)
                split.append(batch.prefix is not None)
                batch.pop_finished()
            if len(batch):
                batch.step()
                batch.pop_finished()
            step += 1
    return rows, split


def test_split_layout_decodes_what_the_flat_layout_decodes(model):
    split_rows, split = run_waves(model, True)
    flat_rows, flat = run_waves(model, False)
    assert split == [True, True, True] and flat == [False, False, False]
    for a, b in zip(split_rows, flat_rows, strict=True):
        assert a.output_ids == b.output_ids, a.request.rid
        assert len(a.output_ids) == a.request.sampling.max_new_tokens
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)


def test_split_layout_only_where_it_serves(model):
    with torch.inference_mode():
        distinct = DecodeBatch(model, 0, None)
        distinct.admit([make_row(k, 6, 3, k) for k in range(3)])  # no prompt shared
        assert distinct.prefix is None
        shared = DecodeBatch(model, 0, None)
        shared.admit([make_row(0, 6, 3, s) for s in range(3)])
        assert shared.prefix is not None and shared.mask.shape == (3, 0)
        assert shared.next_pos.tolist() == [6, 6, 6]
        unserved = DecodeBatch(model, 0, None)
        unserved.direct = None
        unserved.admit([make_row(0, 6, 3, s) for s in range(3)])
        assert unserved.prefix is None


def test_rows_finishing_before_the_first_step(model):
    """Half a fresh split batch ends at its first token: compaction drops their slots (and the
    prompt only they shared) while each row's own cache has no columns yet."""

    def run(share_decode: bool) -> list[Row]:
        specs = [(0, 7, 1, 1), (1, 5, 1, 2), (1, 5, 1, 3), (2, 6, 5, 4), (2, 6, 4, 5), (0, 7, 1, 6)]
        rows = [make_row(*spec) for spec in specs]
        batch = DecodeBatch(model, 0, None)
        batch.share_decode = share_decode
        with torch.inference_mode():
            batch.admit(rows)
            assert (batch.prefix is not None) == share_decode
            batch.pop_finished()
            if share_decode:
                assert batch.prefix.group.tolist() == [0, 0] and batch.cache.layers[0].keys.shape[0] == 2
            while len(batch):
                batch.step()
                batch.pop_finished()
        return rows

    for a, b in zip(run(True), run(False), strict=True):
        assert a.output_ids == b.output_ids and len(a.output_ids) == a.request.sampling.max_new_tokens
