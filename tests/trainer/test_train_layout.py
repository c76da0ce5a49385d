"""Micro-batch layouts (`verst.trainer.train.layout`): the shared-prompt layout equals the padded one.

A real tiny Hugging Face Llama (random weights, built from a config) runs the same sequences in
the padded, packed and shared-prompt layouts; log-probs, entropy and the gradients of a loss
over them w.r.t. every parameter must agree within float32 tolerance — for mixed micro-batches
(groups sharing a prompt, singletons, interleaved order, different prompt and response lengths,
agentic responses whose tool tokens are loss-masked), SDPA, eager and the pieces attention
(`verst.trainer.train.pieces`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from verst.rollout.errors import ConfigError
from verst.trainer.train.batch import micro_batches
from verst.trainer.train.layout import LAYOUTS, DecoderShape, PackedInputs, SharedPromptLayout, prompt_groups
from verst.trainer.train.layout_choice import LayoutChooser, shared_prompt_unsupported
from verst.trainer.train.logprobs import PolicyLogprobs, pack_sequences
from verst.trainer.train.pieces import ATTENTION_NAME, pieces_sdpa, use_pieces_attention

VOCAB = 61


def tiny_llama(attn: str, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        attn_implementation=attn,
        **overrides,
    )
    return LlamaForCausalLM(cfg).float()


MODELS = {attn: PolicyLogprobs(tiny_llama(attn), backend="torch", chunk_size=7) for attn in ("sdpa", "eager")}
_on_pieces = tiny_llama("sdpa")
assert use_pieces_attention(_on_pieces)
MODELS["pieces"] = PolicyLogprobs(_on_pieces, backend="torch", chunk_size=7, pieces_min_saved=0)
"""SDPA switched to the pieces attention, used for every shared-prompt row (`train/pieces.py`)."""


def run(model: PolicyLogprobs, inputs: PackedInputs, weights: torch.Tensor):
    """Log-probs, entropy and parameter gradients of `Σ w·lp + 0.1 Σ w·ent` (w: a loss mask)."""
    model.zero_grad(set_to_none=True)
    lp, ent = model(inputs, temperature=0.8, return_entropy=True)
    ((lp * weights).sum() + 0.1 * (ent * weights).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), ent.detach(), grads


@st.composite
def micro_batch(draw):
    """Groups of samples sharing a prompt (and singletons), shuffled; per-token loss weights."""
    tokens, resp, weights = [], [], []
    for _ in range(draw(st.integers(1, 4))):
        prompt = draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=7))
        for _ in range(draw(st.integers(1, 3))):
            r = draw(st.integers(1, 6))
            response = draw(st.lists(st.integers(1, VOCAB - 1), min_size=r, max_size=r))
            agentic = draw(st.booleans())  # a tool result in the middle of the response: masked
            mask = [0.0 if agentic and 1 <= j < r - 1 else 1.0 for j in range(r)]
            tokens.append(prompt + response)
            resp.append(r)
            weights.append(mask)
    order = draw(st.permutations(range(len(tokens))))
    return [tokens[i] for i in order], [resp[i] for i in order], [w for i in order for w in weights[i]]


@pytest.mark.parametrize("attn", ["sdpa", "eager", "pieces"])
@settings(max_examples=15, deadline=None)
@given(batch=micro_batch())
def test_shared_prompt_and_packed_equal_padded(attn, batch):
    tokens, resp, w = batch
    model, weights = MODELS[attn], torch.tensor(w)
    ref_lp, ref_ent, ref_grads = run(model, pack_sequences(tokens, resp, layout="padded"), weights)
    flat = ("flat",) if attn == "pieces" else ()  # one unpadded row: the pieces attention only
    for layout in ("shared_prompt", "packed", 2, *flat):  # 2: shared prompts, ≤ 2 responses per row
        if layout == "flat":
            inputs = SharedPromptLayout(flat=True).build(tokens, resp)
            assert inputs.input_ids.shape == (1, sum(SharedPromptLayout().row_widths(
                tokens, resp, SharedPromptLayout().rows(tokens, resp))))  # fmt: skip
        elif layout == 2:
            inputs = SharedPromptLayout(per_row=2).build(tokens, resp)
        else:
            inputs = pack_sequences(tokens, resp, layout=layout)
        assert inputs.target_ids.tolist() == [
            t for seq, r in zip(tokens, resp, strict=True) for t in seq[len(seq) - r :]
        ]
        lp, ent, grads = run(model, inputs, weights)
        torch.testing.assert_close(lp, ref_lp, atol=2e-5, rtol=1e-5, msg=lambda m, la=layout: f"{la} lp: {m}")
        torch.testing.assert_close(ent, ref_ent, atol=2e-5, rtol=1e-5, msg=lambda m, la=layout: f"{la}: {m}")
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(
                g, ref_grads[name], atol=2e-5, rtol=1e-4, msg=lambda m, n=name, la=layout: f"{la} {n}: {m}"
            )


def test_shared_prompt_row_layout():
    # seq 0 and 2 share prompt [5, 6]; seq 1 is alone (prompt [5]); order is kept in the targets
    tokens = [[5, 6, 7, 8], [5, 9, 9], [5, 6, 3]]
    out = pack_sequences(tokens, [2, 2, 1], layout="shared_prompt")
    assert prompt_groups(tokens, [2, 2, 1]) == [[0, 2], [1]]
    assert out.input_ids.tolist() == [[5, 6, 7, 8, 3], [5, 9, 9, 0, 0]]
    assert out.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 2, 0, 0]]
    # seq0: predicted by pos 1 (last prompt) and 2; seq1: row 1 pos 0, 1; seq2: pos 1 again (shared)
    assert out.gather_index.tolist() == [1, 2, 5, 6, 1]
    assert out.target_ids.tolist() == [7, 8, 9, 9, 3]
    m = out.attention_mask[0, 0].int().tolist()
    assert m == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 1],  # resp 2 sees the prompt and itself, not resp 1
    ]
    assert SharedPromptLayout(per_row=1).rows(tokens, [2, 2, 1]) == [[0], [2], [1]]
    five = [[5, 6, 7 + j] for j in range(5)]
    assert SharedPromptLayout(per_row=2).rows(five, [1] * 5) == [[0, 1], [2, 3], [4]]  # balanced
    pad = out.attention_mask[1, 0].int().tolist()
    assert pad[3] == [0, 0, 0, 1, 0] and pad[4] == [0, 0, 0, 0, 1]  # padding attends only itself


def shape() -> DecoderShape:
    return DecoderShape.from_config(tiny_llama("sdpa").config)


def test_auto_picks_shared_prompt_for_groups_and_padded_for_distinct_prompts():
    chooser = LayoutChooser.build("auto", config=tiny_llama("sdpa").config, attn="sdpa")
    assert chooser.candidates == ("padded", "packed", "shared_prompt")
    prompt = list(range(1, 41))
    group = [prompt + [7] * 12 for _ in range(8)]
    assert chooser.choose(group, [12] * 8) == "shared_prompt"
    distinct = [[i + 1] * 40 + [7] * 12 for i in range(8)]
    assert chooser.choose(distinct, [12] * 8) == "padded"
    # one long and many short sequences, nothing shared: padding wastes most, packing wins
    ragged = [[1] * 60] + [[i + 2, 3] for i in range(30)]
    assert chooser.choose(ragged, [1] * 31) == "packed"
    # long responses after a mid-sized prompt: one row of 8 attends too widely, 8 rows repeat
    # the prompt 8 times; two rows of 4 responses cost least (tokens 360, pairs 2 x 180^2)
    split = [list(range(1, 61)) + [7 + j] * 30 for j in range(8)]
    assert chooser.pick(split, [30] * 8) == SharedPromptLayout(per_row=4)
    assert chooser.pick(group, [12] * 8) == SharedPromptLayout()
    for name, layout in LAYOUTS.items():  # the cost is what decides
        assert layout.cost(group, [12] * 8, shape(), "sdpa") > 0, name


def test_exact_on_policy_auto_keeps_rows_of_several_sequences_within_one_key_block():
    """`max_width` (the trainer sets `exact_ops.KEY_BLOCK` under train.exact_on_policy): where a
    shared-prompt or packed layout fits in it, 'auto' picks among those and padded; where none
    does, the cost decides as without it."""
    chooser = dataclasses.replace(
        LayoutChooser.build("auto", config=tiny_llama("sdpa").config, attn="sdpa"), max_width=64
    )
    prompt = list(range(1, 7))
    group = [prompt + [7 + j] * 12 for j in range(8)]  # one row: 6 + 96 = 102 wide
    picked = chooser.pick(group, [12] * 8)  # rows of 2 or 4 responses: 30 or 54 wide
    assert isinstance(picked, SharedPromptLayout) and picked.per_row in (2, 4)
    wide = [list(range(1, 61)) + [7 + j] * 30 for j in range(8)]  # 60 + 30 > 64 even alone
    assert chooser.pick(wide, [30] * 8) == dataclasses.replace(chooser, max_width=None).pick(wide, [30] * 8)


@settings(max_examples=30, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 8), min_size=1, max_size=3),
    responses=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    per_row=st.sampled_from([None, 2, 4]),
    flat=st.booleans(),
)
def test_each_layouts_width_is_the_width_it_builds(prompts, responses, per_row, flat):
    """`Layout.width` (what the exact chooser's `max_width` compares) is the row width `build` makes."""
    tokens, resp = [], []
    for g, p in enumerate(prompts):
        for j, r in enumerate(responses):
            tokens.append([g + 1] * p + [10 + j] * r)
            resp.append(r)
    layouts = [*LAYOUTS.values(), SharedPromptLayout(per_row=per_row, flat=flat)]
    for layout in layouts:
        assert layout.width(tokens, resp) == layout.build(tokens, resp).input_ids.shape[1], layout


def test_flat_shared_prompt_row_only_on_the_pieces_attention_and_when_it_saves_padding():
    """One unpadded row of every group (`SharedPromptLayout(flat=True)`): offered on the pieces
    attention only (probed), picked where the rows' padding costs more than the pieces' overhead,
    and refused by a model that does not run the pieces attention."""
    pieces_model = MODELS["pieces"]

    def probe(inputs):
        with torch.no_grad():
            return pieces_model(inputs)[0]

    on_pieces = LayoutChooser.build(
        "auto", config=pieces_model.policy.config, attn=ATTENTION_NAME, probe=probe
    )
    assert on_pieces.flat
    assert not LayoutChooser.build("auto", config=tiny_llama("sdpa").config, attn="sdpa").flat
    assert not LayoutChooser.build("padded", config=pieces_model.policy.config, attn=ATTENTION_NAME).flat
    dropout = tiny_llama("sdpa", attention_dropout=0.1).config
    assert not LayoutChooser.build("auto", config=dropout, attn=ATTENTION_NAME).flat
    # the tiny benchmark's shapes: its model's layer, 8 groups of 8, prompts of 4-11 tokens and
    # responses of 2-10 (its rows were 13-29% padding; flat measured 13% faster there)
    bench = LayoutChooser.build(
        "auto",
        config=LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_attention_heads=4),
        attn=ATTENTION_NAME,
    )
    groups = [(list(range(1, 5 + g)), [2 + g + j % 2 for j in range(8)]) for g in range(8)]  # 35% padding
    tokens = [p + [7] * r for p, rs in groups for r in rs]
    resp = [r for _, rs in groups for r in rs]
    assert bench.flat and bench.pick(tokens, resp) == SharedPromptLayout(flat=True)
    assert on_pieces.pick(tokens, resp) != SharedPromptLayout(
        flat=True
    )  # a 32-wide layer: too little to save
    one_group = tokens[:8]  # one row: no padding to save, the pieces' overhead loses
    assert bench.pick(one_group, resp[:8]) != SharedPromptLayout(flat=True)
    flat = SharedPromptLayout(flat=True).build(tokens, resp)
    assert flat.pieces.flat and flat.input_ids.shape == (1, sum(len(p) + sum(rs) for p, rs in groups))
    with pytest.raises(ValueError, match="flat shared-prompt row needs the policy on the pieces attention"):
        MODELS["sdpa"](flat)
    query = torch.zeros(1, 4, flat.pieces.width, 8)
    key = torch.zeros(1, 2, flat.pieces.width, 8)
    with pytest.raises(ValueError, match="runs on the pieces attention only"):
        pieces_sdpa(None, query, key, key, None, dropout=0.1, shared_pieces=flat.pieces)


def test_flash_attention_never_gets_shared_prompt_and_packs_varlen():
    cfg = tiny_llama("sdpa").config
    chooser = LayoutChooser.build("auto", config=cfg, attn="flash_attention_2")
    assert chooser.candidates == ("padded", "packed")
    ragged = [[1] * 30, [2] * 5, [3] * 9]
    assert chooser.choose(ragged, [2, 2, 2]) == "packed"  # varlen: no padding, linear attention
    with pytest.raises(ConfigError, match="flash_attention_2 takes no custom attention mask"):
        LayoutChooser.build("shared_prompt", config=cfg, attn="flash_attention_2")


def test_fixed_layouts_and_bad_names():
    cfg = tiny_llama("sdpa").config
    assert LayoutChooser.build("padded", config=cfg, attn="sdpa").candidates == ("padded",)
    with pytest.raises(ValueError, match=r"unknown layout 'stacked'.*padded, packed, shared_prompt"):
        LayoutChooser.build("stacked", config=cfg, attn="sdpa")
    with pytest.raises(ValueError, match="unknown layout"):
        pack_sequences([[1, 2]], [1], layout="stacked")


def test_shared_prompt_refused_for_sliding_windows_and_models_that_mix_tokens():
    sliding = tiny_llama("sdpa").config
    sliding.sliding_window = 16
    assert "sliding-window" in shared_prompt_unsupported(sliding)
    auto = LayoutChooser.build("auto", config=sliding, attn="sdpa")
    assert "shared_prompt" not in auto.candidates
    with pytest.raises(ConfigError, match=r"train.layout: .*sliding-window.*\n  fix: set train.layout"):
        LayoutChooser.build("shared_prompt", config=sliding, attn="sdpa")
    model = MODELS["sdpa"]

    def probe(inputs):
        with torch.no_grad():
            return model(inputs)[0]

    assert shared_prompt_unsupported(model.policy.config, probe) is None

    def leaky(inputs):  # a model that ignores the 4D mask: plain causal over the row, responses mix
        return probe(dataclasses.replace(inputs, attention_mask=None))

    assert "differ between the padded and the shared-prompt layout" in shared_prompt_unsupported(
        model.policy.config, leaky
    )


# ---------------------------------------------------------------- micro-batches keep groups together


@given(
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=12), mbs=st.integers(1, 9), world=st.integers(1, 3)
)
def test_micro_batches_with_group_keys_keep_the_contract(sizes, mbs, world):
    keys = [g for g, size in enumerate(sizes) for _ in range(size)]
    n = len(keys)
    per_rank = [micro_batches(list(range(n)), mbs, rank=r, world_size=world, keys=keys) for r in range(world)]
    plain = [micro_batches(list(range(n)), mbs, rank=r, world_size=world) for r in range(world)]
    assert [len(m) for m in per_rank] == [len(m) for m in plain]  # same count as without keys
    assert sorted(i for m in per_rank for mb in m for i in mb) == list(range(n))
    assert all(len(mb) <= mbs for m in per_rank for mb in m)
    for m, p in zip(per_rank, plain, strict=True):  # no more empty micro-batches than before
        assert sum(not mb for mb in m) == sum(not mb for mb in p)


@given(g=st.integers(1, 8), groups=st.integers(1, 6), per_mb=st.integers(1, 3), world=st.integers(1, 3))
def test_micro_batches_never_split_a_group_when_sizes_allow(g, groups, per_mb, world):
    """Groups of g, micro-batches of a multiple of g, every rank a whole number of groups."""
    keys = [i // g for i in range(world * groups * g)]
    for r in range(world):
        for mb in micro_batches(range(len(keys)), per_mb * g, rank=r, world_size=world, keys=keys):
            assert not mb or (mb[0] % g == 0 and len(mb) % g == 0), (mb, g)  # whole groups only


# ---------------------------------------------------------------- config and the train side


def test_layout_config_keeps_old_packing_configs_and_reports_bad_values(tmp_path):
    from verst.trainer.config import TrainConfig, layout_problems, load_run_config

    assert TrainConfig(packing=False).effective_layout == "padded"  # old configs mean what they meant
    assert TrainConfig(packing=True).effective_layout == "packed"
    assert TrainConfig().effective_layout == "auto"
    assert TrainConfig(layout="shared_prompt").effective_layout == "shared_prompt"
    assert layout_problems(TrainConfig(packing=False, layout="padded"), cuda_available=False) == []
    (clash,) = layout_problems(TrainConfig(packing=False, layout="shared_prompt"), cuda_available=False)
    assert clash.key == "train.packing" and "'padded'" in clash.why and "remove train.packing" in clash.fix
    (fa2,) = layout_problems(
        TrainConfig(layout="shared_prompt", attn_implementation="flash_attention_2"), cuda_available=True
    )
    assert fa2.key == "train.layout" and "flash_attention_2" in fa2.why
    path = tmp_path / "c.toml"
    path.write_text('[train]\nmodel_path = "/m"\nlayout = "stacked"\n')
    with pytest.raises(ConfigError) as info:
        load_run_config(path, [])
    (bad,) = info.value.problems
    assert bad.key == "train.layout" and "shared_prompt" in str(bad)


@pytest.fixture(scope="module")
def group_batch(tiny_checkpoint):
    """Two groups of 3 sharing a prompt each (different lengths), one agentic sample."""
    from verst.rollout.sample import Sample, Status
    from verst.trainer.train.batch import build_train_batch

    gen = torch.Generator().manual_seed(3)
    groups = []
    for g, p in enumerate((5, 9)):
        prompt = torch.randint(4, 30, (p,), generator=gen).tolist()
        group = []
        for j in range(3):
            r = 2 + (g + 2 * j) % 5
            mask = [1] * r if (g, j) != (1, 1) else [1, 0, 0] + [1] * (r - 3)  # a masked tool result
            group.append(
                Sample(
                    prompt=str(g),
                    tokens=prompt + torch.randint(4, 30, (r,), generator=gen).tolist(),
                    response_length=r,
                    loss_mask=mask,
                    reward=float(j),
                    status=Status.COMPLETED,
                    rollout_logprobs=[-2.0] * r,
                    group_index=g,
                    sample_index=3 * g + j,
                )
            )
        groups.append(group)
    return build_train_batch(groups)


def _side(tiny_checkpoint, **train):
    from verst.trainer.algorithms import AlgorithmConfig
    from verst.trainer.config import TrainConfig
    from verst.trainer.train.side import TrainSide

    # eps = 1: AdamW's first update is ~ lr * grad (not lr * sign(grad)), so weights compare like grads
    cfg = TrainConfig(model_path=str(tiny_checkpoint), micro_batch_size=3, lr=1e-2, eps=1.0, **train)
    return TrainSide(
        cfg,
        AlgorithmConfig(),
        model_path=str(tiny_checkpoint),
        total_steps=1,
        max_response_len=8,
        temperature=1.0,
        env={},
    )


def test_train_side_shared_prompt_step_equals_padded(tiny_checkpoint, group_batch):
    padded = _side(tiny_checkpoint, layout="padded")
    shared = _side(tiny_checkpoint, layout="shared_prompt")
    auto = _side(tiny_checkpoint)
    assert auto.layout.candidates == ("padded", "packed", "shared_prompt")  # the probe passed
    mask = group_batch.loss_mask
    ref = padded.compute_old_logprobs(group_batch)
    for side in (shared, auto):
        torch.testing.assert_close(
            side.compute_old_logprobs(group_batch) * mask, ref * mask, atol=1e-5, rtol=0
        )
    assert shared.layout_counts == {"shared_prompt": 2}  # one micro-batch per group
    m_padded, m_shared = padded.train_step(group_batch), shared.train_step(group_batch)
    for key in ("train/loss", "train/entropy", "train/grad_norm"):
        assert m_shared[key] == pytest.approx(m_padded[key], rel=1e-4, abs=1e-6), key
    after = {n: p.detach() for n, p in padded.bundle.hf_model.named_parameters()}
    for n, p in shared.bundle.hf_model.named_parameters():
        torch.testing.assert_close(p.detach(), after[n], atol=1e-7, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
