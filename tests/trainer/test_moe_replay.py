"""Routing replay: the recorded routing reaches the right positions in every layout (a hypothesis
property), the replay hooks reproduce a recorded routing exactly with gradients through the
gate, and replay removes an engine-vs-trainer log-prob mismatch caused by flipped experts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verst.rollout.moe import RoutedExperts, RouterHooks, find_routers, moe_spec
from verst.rollout.toy_moe import MOE_FAMILIES, build_tiny_moe
from verst.trainer.train.layout import LAYOUTS, SharedPromptLayout
from verst.trainer.train.moe import RoutingTable, load_balancing_loss, routing_agreement


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[list[int]], list[int]]:
    """Sequences in groups that share a prompt (as GRPO's do), with ragged responses."""
    seqs, lens = [], []
    for _ in range(draw(st.integers(1, 4))):
        prompt = draw(st.lists(st.integers(3, 40), min_size=1, max_size=6))
        for _ in range(draw(st.integers(1, 4))):
            resp = draw(st.lists(st.integers(3, 40), min_size=0, max_size=5))
            seqs.append(prompt + resp)
            lens.append(len(resp))
    return seqs, lens


LAYOUT_CHOICES = [*LAYOUTS.values(), SharedPromptLayout(per_row=2)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(), st.sampled_from(LAYOUT_CHOICES), st.data())
def test_gather_puts_each_recorded_choice_at_its_position_in_any_layout(batch, layout, data) -> None:
    """Whatever the recorded ids, padding and layout: the routing gathered for a laid-out position
    is the one recorded for that sequence's position (the first sample with the same prompt's, on
    prompt positions), padding gets -1, and every prediction of a response token sees its own."""
    tokens, lens = batch
    rows = data.draw(st.permutations(range(len(tokens))))  # a micro-batch in any order
    # ids that name their (sequence, position): layer 0 = sequence, layer 1 = position
    routed = [
        RoutedExperts.from_ints([v for p in range(len(s) - 1) for v in (i, i, p, p)], 4)
        for i, s in enumerate(tokens)
    ]
    table = RoutingTable.from_samples(tokens, lens, routed, layers=2, k=2)
    real = layout.build([tokens[i] for i in rows], [lens[i] for i in rows])
    index = table.index_for(layout, tokens, lens, rows)
    got = table.gather(index)  # [rows * width, 2, 2]
    flat_ids = real.input_ids.reshape(-1)
    flat_pos = real.position_ids.reshape(-1)
    assert index.shape == flat_ids.shape
    canon = table.canonical
    for f in range(index.numel()):
        if index[f] < 0:
            assert (got[f] == -1).all()
            continue
        seq, pos = int(got[f, 0, 0]), int(got[f, 1, 0])
        if seq < 0:  # a sequence's last token: the engine never ran a forward on it as input
            continue
        assert tokens[seq][pos] == int(flat_ids[f]) and pos == int(flat_pos[f])
    # each response prediction: its own sequence's routing (the last prompt position: canonical)
    k = 0
    for i in rows:
        p = len(tokens[i]) - lens[i]
        for j in range(lens[i]):
            f = int(real.gather_index[k])
            seq, pos = int(got[f, 0, 0]), int(got[f, 1, 0])
            assert pos == p - 1 + j
            assert seq == i or (j == 0 and canon[seq] == canon[i])  # the group's shared prompt row
            k += 1


def test_unrecorded_samples_route_freely() -> None:
    tokens, lens = [[5, 6, 7, 8], [9, 9, 9]], [2, 1]
    table = RoutingTable.from_samples(tokens, lens, [None, RoutedExperts.unrecorded(2, 2)], layers=1, k=2)
    assert (table.ids == -1).all()


def test_routing_of_another_model_is_refused() -> None:
    with pytest.raises(ValueError, match="another model"):
        RoutingTable.from_samples([[1, 2, 3]], [1], [RoutedExperts.from_ints([0, 1] * 2, 2)], layers=4, k=2)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replay_reproduces_a_recorded_routing_with_gradients_through_the_gate(family: str) -> None:
    torch.manual_seed(0)
    model = build_tiny_moe(family, 64, num_layers=2)
    hooks = RouterHooks(model, keep_logits=True)
    assert moe_spec(model.config) == (2, 2, 8) and len(find_routers(model)) == 2
    ids = torch.randint(4, 60, (2, 7))
    with torch.no_grad():
        free = model(ids).logits
    recorded = hooks.chosen()  # [14, layers, k]
    other = torch.stack([recorded[..., 1], recorded[..., 0]], -1)  # the same sets, other order
    hooks.replay = other
    replayed = model(ids).logits
    assert torch.allclose(replayed, free, atol=1e-6)
    agree, total = routing_agreement(hooks.free_choice(), other, hooks.router_layers)
    assert agree == total == 14 * 2  # agreement 1.0
    assert torch.equal(hooks.chosen(), other)
    shifted = (recorded + 3) % 8  # different experts: the output moves, the router gets gradient
    hooks.replay = shifted
    out = model(ids).logits
    assert (out - free).abs().max() > 1e-3
    assert torch.equal(hooks.chosen(), shifted)
    out.square().mean().backward()
    gate = find_routers(model)[0][1].weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0
    aux = load_balancing_loss(hooks.logits, hooks.chosen(), torch.ones(14, dtype=torch.bool), 8)
    assert aux.requires_grad and aux.item() > 0
    hooks.close()


def test_dense_model_has_nothing_to_replay() -> None:
    from verst.rollout.toy import build_tiny_llama

    with pytest.raises(ValueError, match="dense"):
        RouterHooks(build_tiny_llama(64, num_layers=1))
