"""One train step's plan (`verst.trainer.train.plan`): split, grouping and layout choice once.

Properties over random batches (groups of samples sharing a prompt, singletons, interleaved
order): the plan's mini- and micro-batches are exactly the splits the step made before
(`split_even`, `micro_batches` keyed by prompt), each micro-batch's groups are its prompt groups,
and the planned inputs equal what `LayoutChooser.lay_out` builds from scratch. Then the data
flow itself: over a whole step (a log-prob pass and a training pass over every micro-batch) the
batch is grouped by prompt once and each micro-batch's layout is picked once per chooser.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

import verst.trainer.train.layout as layout_module
import verst.trainer.train.layout_choice as choice_module
import verst.trainer.train.plan as plan_module
from verst.trainer.train.batch import TrainBatch, micro_batches, split_even
from verst.trainer.train.layout import prompt_groups, prompt_keys
from verst.trainer.train.layout_choice import LayoutChooser
from verst.trainer.train.plan import StepPlan

CONFIG = LlamaConfig(
    vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip


def make_batch(seqs: list[tuple[list[int], list[int]]]) -> TrainBatch:
    tokens = [p + r for p, r in seqs]
    lens = [len(r) for _, r in seqs]
    width = max(lens)
    return TrainBatch(
        tokens=tokens,
        response_lengths=lens,
        loss_mask=torch.ones(len(seqs), width),
        rollout_logprobs=torch.zeros(len(seqs), width),
        has_rollout_logprobs=False,
        rewards=torch.zeros(1, len(seqs)),
        group_size=len(seqs),
        weight_versions=[[0]] * len(seqs),
        prompts=[],
    )


@st.composite
def batches(draw):
    prompts = draw(st.lists(st.lists(st.integers(1, 60), min_size=1, max_size=6), min_size=1, max_size=4))
    picks = draw(st.lists(st.integers(0, len(prompts) - 1), min_size=1, max_size=12))
    responses = draw(
        st.lists(
            st.lists(st.integers(1, 60), min_size=1, max_size=5), min_size=len(picks), max_size=len(picks)
        )
    )
    return make_batch([(prompts[p], r) for p, r in zip(picks, responses, strict=True)])


@settings(max_examples=60, deadline=None)
@given(batches(), st.integers(1, 4), st.integers(1, 3), st.integers(1, 2), st.data())
def test_the_plan_is_the_steps_split_with_its_prompt_groups(batch, mbs, updates, world, data):
    rank = data.draw(st.integers(0, world - 1))
    plan = StepPlan.build(batch, micro_batch_size=mbs, num_updates=updates, rank=rank, world_size=world)
    keys = prompt_keys(batch.tokens, batch.response_lengths)
    assert plan.keys == keys
    assert plan.updates == split_even(list(range(batch.num_samples)), updates)
    want_all = micro_batches(range(batch.num_samples), mbs, rank=rank, world_size=world, keys=keys)
    assert [list(mb.rows) for mb in plan.all_micro_batches] == want_all
    for rows, planned in zip(plan.updates, plan.update_micro_batches, strict=True):
        assert [list(mb.rows) for mb in planned] == micro_batches(
            rows, mbs, rank=rank, world_size=world, keys=keys
        )
    for mb in [*plan.all_micro_batches, *(m for u in plan.update_micro_batches for m in u)]:
        tokens, lens = mb.sequences(batch)
        assert [list(g) for g in mb.groups] == (prompt_groups(tokens, lens) if mb.rows else [])


@settings(max_examples=40, deadline=None)
@given(batches(), st.integers(1, 4))
def test_planned_inputs_equal_a_fresh_lay_out(batch, mbs):
    chooser = LayoutChooser.build("auto", config=CONFIG, attn="sdpa")
    plan = StepPlan.build(batch, micro_batch_size=mbs, num_updates=1, rank=0, world_size=1)
    for mb in plan.all_micro_batches:
        if not mb.rows:
            continue
        tokens, lens = mb.sequences(batch)
        fresh, planned = chooser.lay_out(tokens, lens), plan.inputs(chooser, batch, mb)
        assert planned.layout == fresh.layout
        for field in ("input_ids", "position_ids", "attention_mask", "gather_index", "target_ids"):
            a, b = getattr(planned, field), getattr(fresh, field)
            assert (a is None and b is None) or torch.equal(a, b), field


def test_a_step_groups_once_and_picks_each_layout_once(monkeypatch):
    counts = {"groups": 0, "pick": 0}
    real_groups, real_pick = layout_module.prompt_groups, LayoutChooser.pick

    def counting_groups(*args, **kwargs):
        counts["groups"] += 1
        return real_groups(*args, **kwargs)

    def counting_pick(self, *args, **kwargs):
        counts["pick"] += 1
        return real_pick(self, *args, **kwargs)

    monkeypatch.setattr(layout_module, "prompt_groups", counting_groups)
    monkeypatch.setattr(plan_module, "prompt_groups", counting_groups)
    monkeypatch.setattr(choice_module, "prompt_groups", counting_groups)
    monkeypatch.setattr(LayoutChooser, "pick", counting_pick)
    prompt = list(range(1, 21))
    batch = make_batch([(prompt, [7, 8 + j]) for j in range(4)] + [([5] * 9, [3] * 6) for _ in range(4)])
    chooser = LayoutChooser.build("auto", config=CONFIG, attn="sdpa")
    assert chooser.candidates[-1] == "shared_prompt"  # grouping matters to this chooser
    counts.update(groups=0, pick=0)
    plan = StepPlan.build(batch, micro_batch_size=4, num_updates=1, rank=0, world_size=1)
    for _ in range(3):  # reference, old policy, training forward
        for mb in plan.update_micro_batches[0]:
            plan.inputs(chooser, batch, mb)
    assert counts["groups"] == 1, "the batch is grouped by prompt once per step"
    assert counts["pick"] == len(plan.update_micro_batches[0]) == 2
