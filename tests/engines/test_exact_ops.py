"""The batch-invariant ops of `train.exact_on_policy` (`verst.rollout.exact_ops`), under hypothesis.

A token's result must be the same bits whatever the rest of the call: a linear layer's row for
any row count and place; a query's attention as a decode step over a left-padded cache in a
batch of other rows, as one position of a full causal pass, and as a row of a right-padded
batch, for any lengths, head counts (grouped KV heads too) and 1 or 2 threads; a sequence in a
packed or shared-prompt row as that sequence alone. The plain ops
these replace fail the same properties (checked here too, so the test knows what it proves).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from verst.rollout.exact_ops import KEY_BLOCK, DecodeStep, exact_attention, exact_linear, exact_silu


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 700),
    k=st.sampled_from([32, 64, 128, 192]),
    n=st.sampled_from([16, 64, 72, 256]),
    seed=st.integers(0, 2**16),
    threads=st.sampled_from([1, 2]),
)
def test_linear_row_is_the_same_for_any_row_count_and_place(m, k, n, seed, threads):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=g), torch.randn(k, generator=g)
    alone = exact_linear(x[None], w)[0]
    batch = torch.randn(m, k, generator=g)
    at = seed % m
    batch[at] = x
    assert torch.equal(exact_linear(batch, w)[at], alone)


def test_plain_linear_row_depends_on_the_row_count():
    """What `exact_linear` fixes: M = 1 (GEMV) and M = 2-3 round differently from M >= 4."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(64, 64, generator=g), torch.randn(8, 64, generator=g)
    assert not torch.equal(F.linear(x[:1], w)[0], F.linear(x, w)[0])


@settings(max_examples=40, deadline=None)
@given(
    length=st.integers(1, 300),
    kv=st.sampled_from([1, 2, 4]),
    rep=st.sampled_from([1, 3]),
    d=st.sampled_from([16, 32]),
    batch=st.sampled_from([1, 3, 8, 64]),
    pad=st.integers(0, 40),
    seed=st.integers(0, 2**16),
    threads=st.sampled_from([1, 2]),
)
def test_attention_query_is_the_same_in_decode_full_and_padded_passes(
    length, kv, rep, d, batch, pad, seed, threads
):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(seed)
    h, s = kv * rep, d**-0.5
    q, k, v = (torch.randn(1, n, length, d, generator=g) for n in (h, kv, kv))
    full, _ = exact_attention(None, q, k, v, None, scaling=s)  # [1, T, h, d] causal
    p = seed % length  # the query position checked
    # decode: row r of a batch, its cache left-padded by `pad`, the other rows random
    cols = pad + p + 1
    kk, vv, qq = torch.randn(batch, kv, cols, d), torch.randn(batch, kv, cols, d), torch.randn(batch, h, 1, d)
    r = seed % batch
    kk[r, :, pad:], vv[r, :, pad:], qq[r, :, 0] = k[0, :, : p + 1], v[0, :, : p + 1], q[0, :, p]
    mask = torch.ones(batch, 1, 1, cols, dtype=torch.bool)
    mask[r, ..., :pad] = False
    dec, _ = exact_attention(None, qq, kk, vv, mask, scaling=s)
    assert torch.equal(dec[r, 0], full[0, p])
    # right-padded rows of a training micro-batch (additive mask, as the trainer gives it)
    width = length + pad
    k2, v2, q2 = torch.randn(2, kv, width, d), torch.randn(2, kv, width, d), torch.randn(2, h, width, d)
    k2[1, :, :length], v2[1, :, :length], q2[1, :, :length] = k[0], v[0], q[0]
    allowed = torch.tril(torch.ones(width, width, dtype=torch.bool))[None, None].repeat(2, 1, 1, 1)
    allowed[1, ..., length:] = False
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    padded, _ = exact_attention(None, q2, k2, v2, additive, scaling=s)
    assert torch.equal(padded[1, p], full[0, p])


@settings(max_examples=30, deadline=None)
@given(
    prompt=st.integers(1, 40),
    responses=st.lists(st.integers(1, 30), min_size=1, max_size=5),
    kv=st.sampled_from([1, 2]),
    rep=st.sampled_from([1, 3]),
    pad=st.integers(0, 20),
    shared=st.booleans(),
    seed=st.integers(0, 2**16),
    threads=st.sampled_from([1, 2]),
)
def test_packed_and_shared_prompt_rows_give_each_sequence_its_own_bits(
    prompt, responses, kv, rep, pad, shared, seed, threads
):
    """A row holding several causal sequences — packed (`[s_1, s_2, ...]`, block-diagonal) or a
    shared prompt (`[prompt, resp_1, ..., resp_k]`, each response sees the prompt and itself),
    right-padded with tokens that see only themselves — gives every query of sequence i the
    bits of sequence i alone in a padded row."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(seed)
    h, d, s = kv * rep, 16, 16**-0.5
    seqs = []  # per sequence: its columns in the row
    col = 0
    if shared:
        p_cols = list(range(prompt))
        col = prompt
        for r in responses:
            seqs.append(p_cols + list(range(col, col + r)))
            col += r
    else:
        for r in responses:
            seqs.append(list(range(col, col + prompt + r)))
            col += prompt + r
    width = col + pad
    q, k, v = (torch.randn(1, n, width, d, generator=g) for n in (h, kv, kv))
    allowed = torch.eye(width, dtype=torch.bool)
    for cols in seqs:
        c = torch.tensor(cols)
        allowed[c[:, None], c[None, :]] = torch.ones(len(cols), len(cols), dtype=torch.bool).tril()
    out, _ = exact_attention(None, q, k, v, allowed[None, None], scaling=s)
    for cols in seqs:
        c = torch.tensor(cols)
        alone, _ = exact_attention(None, q[:, :, c], k[:, :, c], v[:, :, c], None, scaling=s)
        assert torch.equal(out[0, c], alone[0])


@settings(max_examples=40, deadline=None)
@given(
    length=st.integers(KEY_BLOCK + 1, 200),
    cols=st.integers(1, KEY_BLOCK),
    kv=st.sampled_from([1, 2]),
    rep=st.sampled_from([1, 3]),
    d=st.sampled_from([16, 32, 24]),
    batch=st.sampled_from([1, 5, 8]),
    seed=st.integers(0, 2**16),
    threads=st.sampled_from([1, 2, 4]),
)
def test_one_block_call_with_holes_gives_the_blocked_bits(length, cols, kv, rep, d, batch, seed, threads):
    """A call of at most KEY_BLOCK key columns moves no key (`_one_block_attention`): a decode
    query whose keys sit anywhere in its columns, in order, with masked holes between them (a
    split cache's new wave, another response's tokens), gets the bits its position has in a
    full causal pass longer than KEY_BLOCK (gathered, blocked: `_aligned_attention`)."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(seed)
    h, s = kv * rep, d**-0.5
    q, k, v = (torch.randn(1, n, length, d, generator=g) for n in (h, kv, kv))
    full, _ = exact_attention(None, q, k, v, None, scaling=s)
    keep = torch.randperm(cols, generator=g)[: 1 + seed % cols].sort().values  # the row's key columns
    p = keep.numel() - 1  # the query's position
    kk, vv, qq = torch.randn(batch, kv, cols, d), torch.randn(batch, kv, cols, d), torch.randn(batch, h, 1, d)
    r = seed % batch
    kk[r][:, keep], vv[r][:, keep], qq[r, :, 0] = k[0, :, : p + 1], v[0, :, : p + 1], q[0, :, p]
    mask = torch.ones(batch, 1, 1, cols, dtype=torch.bool)
    mask[r] = False
    mask[r, ..., keep] = True
    dec, _ = exact_attention(None, qq, kk, vv, mask, scaling=s)
    assert torch.equal(dec[r, 0], full[0, p])


@settings(max_examples=40, deadline=None)
@given(
    prompt=st.integers(1, 80),
    own=st.integers(0, 60),
    kv=st.sampled_from([1, 2]),
    rep=st.sampled_from([1, 3]),
    d=st.sampled_from([16, 24]),
    batch=st.sampled_from([1, 5, 8]),
    seed=st.integers(0, 2**16),
    threads=st.sampled_from([1, 2]),
)
def test_decode_step_on_key_parts_gives_the_joined_keys_bits(prompt, own, kv, rep, d, batch, seed, threads):
    """`DecodeStep` (the engine's exact decode: the mask made once per step, a split cache's
    prompt and own keys written straight into the GEMM operands) gives `exact_attention`'s bits
    on the joined keys, one block or many, with masked holes (left padding) in the prompt."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(seed)
    h = kv * rep
    q = torch.randn(batch, h, 1, d, generator=g)
    pk, pv = torch.randn(batch, kv, prompt, d, generator=g), torch.randn(batch, kv, prompt, d, generator=g)
    k, v = torch.randn(batch, kv, own, d, generator=g), torch.randn(batch, kv, own, d, generator=g)
    allowed = torch.rand(batch, 1, 1, prompt + own, generator=g) < 0.8
    allowed[..., -1] = True
    bias = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    parts = DecodeStep(bias)(q, [pk, k], [pv, v], d**-0.5)
    joined, _ = exact_attention(None, q, torch.cat([pk, k], 2), torch.cat([pv, v], 2), bias, scaling=d**-0.5)
    assert torch.equal(parts, joined)


def test_attention_refuses_long_rows_that_are_not_causal_sequences():
    """Past KEY_BLOCK columns the keys are moved into position order: a query that sees a later
    key, or two queries whose keys are not one chain, would be approximated there: refused."""
    n = KEY_BLOCK + 5
    q = k = v = torch.randn(1, 2, n, 16)
    ahead = torch.tril(torch.ones(n, n, dtype=torch.bool))
    ahead[1, 3] = True  # position 1 sees position 3
    crossed = torch.tril(torch.ones(n, n, dtype=torch.bool))
    crossed[n - 1, 2] = False  # the last position skips 2 but the one before, which it sees, sees 2
    for allowed in (ahead, crossed):
        try:
            exact_attention(None, q, k, v, allowed[None, None], scaling=0.25)
        except ValueError as exc:
            assert "exact_on_policy" in str(exc)
        else:
            raise AssertionError("a row that is not causal sequences was attended")


def test_silu_agrees_between_vector_body_and_scalar_tail():
    """torch's vectorised `silu` and its scalar tail differ in some values; `exact_silu` does not."""
    x = torch.randn(1 << 14, generator=torch.Generator().manual_seed(0)) * 4
    vec, vec_plain = exact_silu(x), F.silu(x)
    tail = torch.stack([exact_silu(x[i : i + 1])[0] for i in range(2000)])
    tail_plain = torch.stack([F.silu(x[i : i + 1])[0] for i in range(2000)])
    assert torch.equal(tail, vec[:2000])
    assert not torch.equal(tail_plain, vec_plain[:2000])
