"""What a refit ships (`verst.trainer.sync.plan`): after every push the engine's weights equal
the trainer's cast to the engine's dtype; tied aliases never travel; frozen weights go once and
again whenever the engine may have lost them (an update from elsewhere, a new `WeightSync`);
16-bit engines get 16-bit bytes (in-process tensors stay as trained: no wire); `sync/bytes`
counts what went."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from train_testlib import run_dict, write_prompts

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.engines.sglang.launcher import free_port, launch_verst_servers
from verst.rollout.toy import build_tiny_llama, save_with_char_tokenizer, toy_groups
from verst.trainer.config import run_config_from_dict
from verst.trainer.run.rollout_side import RolloutSide
from verst.trainer.sync.plan import ShipPlan, apply_plan, planned_nbytes, static_names
from verst.trainer.sync.weight_sync import WeightSync
from verst.trainer.train.batch import build_train_batch
from verst.trainer.train.fsdp import DistInfo
from verst.trainer.train.side import TrainSide

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def tied_checkpoint(path, seed: int = 0):
    """The tiny Llama with tied embeddings (as SmolLM2's), saved with the char tokenizer."""
    return save_with_char_tokenizer(path, functools.partial(_tied, seed=seed))


def _tied(vocab_size: int, *, seed: int, **ids):
    model = build_tiny_llama(vocab_size, seed=seed, hidden_size=32, num_layers=2, num_heads=2, **ids)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    return model


@pytest.fixture()
def tied(tmp_path_factory):
    return tied_checkpoint(tmp_path_factory.mktemp("tied") / "model")


def _train_side(tmp_path, model_path) -> tuple[object, TrainSide]:
    torch.set_num_threads(1)
    data = write_prompts(tmp_path / "p.jsonl", n=4)
    cfg = run_config_from_dict(run_dict(model_path, data, train={"lr": 3e-2}))
    train = TrainSide(
        cfg.train, cfg.algorithm, model_path=str(model_path), total_steps=4, max_response_len=8,
        temperature=1.0, env={},
    )  # fmt: skip
    model = train.bundle.hf_model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as saved
    model.model.embed_tokens.requires_grad_(False)  # a frozen part (the stand-in for a frozen tower)
    return cfg, train


def _step(train: TrainSide, seed: int) -> None:
    vocab = train.bundle.hf_model.config.vocab_size
    train.train_step(build_train_batch(toy_groups(vocab, seed=seed)))


def _engine_matches(engine: EmbeddedEngine, train: TrainSide) -> None:
    ours = train.bundle.hf_model.state_dict()
    theirs = engine.model.state_dict()
    dtype = next(engine.model.parameters()).dtype
    for name, t in ours.items():
        assert torch.equal(theirs[name], t.detach().to(dtype)), name


def _bytes(train: TrainSide, names, itemsize: int | None = None) -> int:
    sd = train.bundle.hf_model.state_dict()
    return sum(sd[n].numel() * (itemsize or sd[n].element_size()) for n in names)


def test_static_names_of_a_tied_model_with_a_frozen_part(tmp_path, tied):
    _, train = _train_side(tmp_path, tied)
    frozen, aliases = static_names(train.bundle.hf_model)
    assert frozen == {EMBED} and aliases == {HEAD}


def test_tensors_in_process_frozen_once_aliases_never(tmp_path, tied):
    cfg, train = _train_side(tmp_path, tied)
    engine = EmbeddedEngine.from_pretrained(tied_checkpoint(tmp_path / "other", seed=1), dtype="bfloat16")
    side = RolloutSide(cfg, model_path=str(tied), env={}, engine=engine)
    try:
        sync = WeightSync(train, side, mode="tensors", staging_dir=tmp_path / "w", dist_info=DistInfo())
        every = set(train.bundle.hf_model.state_dict())
        trainable = every - {EMBED, HEAD}
        assert sync.planner is not None and sync.planner.wire_dtype is None  # in process: no wire

        _step(train, 0)
        assert sync.push() == 1 and sync.last_full  # the first push: everything but the alias
        assert sync.last_bytes == _bytes(train, every - {HEAD})
        _engine_matches(engine, train)  # the engine started from other weights: all replaced

        _step(train, 1)
        assert sync.push() == 2 and not sync.last_full  # the frozen embedding stays home
        assert sync.last_bytes == _bytes(train, trainable)
        _engine_matches(engine, train)

        # an update from elsewhere (fault): the engine is not at the version this sync left it
        side.update_weights_from_tensors({EMBED: torch.zeros_like(engine.model.state_dict()[EMBED])}, 9)
        _step(train, 2)
        assert sync.push() == 3 and sync.last_full  # everything again, the embedding restored
        _engine_matches(engine, train)

        # a failed push trusts nothing afterwards
        sync.planner.plan(train, side)  # a push that began and never finished
        _step(train, 3)
        assert sync.push() == 4 and sync.last_full
        _engine_matches(engine, train)

        # a new WeightSync (a resumed run, a restarted trainer) sends everything once
        fresh = WeightSync(train, side, mode="tensors", staging_dir=tmp_path / "w", dist_info=DistInfo(),
                           weight_version=4)  # fmt: skip
        assert fresh.push() == 5 and fresh.last_full

        # every_tensor: the old behaviour (the alias and the frozen part every push)
        old = WeightSync(train, side, mode={"type": "tensors", "every_tensor": True},
                         staging_dir=tmp_path / "w", dist_info=DistInfo(), weight_version=5)  # fmt: skip
        assert old.push() == 6 and old.push() == 7 and old.last_bytes == _bytes(train, every)
    finally:
        side.close()


def test_no_frozen_weights_no_replica_round_trips(tmp_path, tied):
    """With nothing frozen no weight can stay home, so a push does not ask the engines for their
    replica states (two round trips to the rollout loop each push); every push sends every
    trainable tensor, and a weight frozen later is still sent until the engine is known to hold it."""
    cfg, train = _train_side(tmp_path, tied)
    train.bundle.hf_model.model.embed_tokens.requires_grad_(True)  # nothing frozen
    engine = EmbeddedEngine.from_pretrained(tied_checkpoint(tmp_path / "other", seed=1))
    side = RolloutSide(cfg, model_path=str(tied), env={}, engine=engine)
    asked = []
    real_states = side.replica_states

    def counted():
        asked.append(1)
        return real_states()

    side.replica_states = counted  # the real states, counted
    try:
        sync = WeightSync(train, side, mode="tensors", staging_dir=tmp_path / "w", dist_info=DistInfo())
        every = set(train.bundle.hf_model.state_dict())
        for v in (1, 2, 3):
            _step(train, v)
            assert sync.push() == v and sync.last_full
            assert sync.last_bytes == _bytes(train, every - {HEAD})
            _engine_matches(engine, train)
        assert not asked
        # a weight frozen from now on: the first push after sends it (the engine's state unknown),
        # the next one may leave it home
        train.bundle.hf_model.model.embed_tokens.requires_grad_(False)
        _step(train, 4)
        assert sync.push() == 4 and sync.last_full and asked
        _step(train, 5)
        assert sync.push() == 5 and not sync.last_full
        _engine_matches(engine, train)
    finally:
        side.close()


def test_disk_to_a_bf16_engine_writes_bf16(tmp_path, tied):
    cfg, train = _train_side(tmp_path, tied)
    engine = EmbeddedEngine.from_pretrained(tied, dtype="bfloat16")
    side = RolloutSide(cfg, model_path=str(tied), env={}, engine=engine)
    try:
        sync = WeightSync(train, side, mode="disk", staging_dir=tmp_path / "w", dist_info=DistInfo())
        _step(train, 0)
        assert sync.push() == 1
        every = set(train.bundle.hf_model.state_dict()) - {HEAD}
        assert sync.last_bytes == _bytes(train, every, itemsize=2)  # half of float32
        with safe_open(str(tmp_path / "w" / "v1" / "model.safetensors"), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118
        _engine_matches(engine, train)  # the same bf16 weights the engine's own cast gives

        trained = WeightSync(train, side, mode={"type": "disk", "wire_dtype": "trained"},
                             staging_dir=tmp_path / "t", dist_info=DistInfo(), weight_version=1)  # fmt: skip
        assert trained.push() == 2 and trained.last_bytes == _bytes(train, every)
        _engine_matches(engine, train)
    finally:
        side.close()


def test_a_float32_engine_gets_float32(tmp_path, tied):
    cfg, train = _train_side(tmp_path, tied)
    side = RolloutSide(cfg, model_path=str(tied), env={}, engine=EmbeddedEngine.from_pretrained(tied))
    try:
        sync = WeightSync(train, side, mode="disk", staging_dir=tmp_path / "w", dist_info=DistInfo())
        assert sync.planner is not None and sync.planner.wire_dtype is None
        _step(train, 0)
        sync.push()
        assert sync.last_bytes == _bytes(train, set(train.bundle.hf_model.state_dict()) - {HEAD})
        _engine_matches(side.engine, train)
    finally:
        side.close()


_dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.int64])


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(_dtypes, st.integers(0, 5), st.booleans()), min_size=0, max_size=6),
    st.sampled_from([None, "bfloat16", "float16"]),
)
def test_planned_nbytes_counts_what_apply_plan_ships(entries, dtype):
    state = {f"t{i}": torch.ones(n, dtype=d) for i, (d, n, _) in enumerate(entries)}
    plan = ShipPlan(frozenset(f"t{i}" for i, (_, _, s) in enumerate(entries) if s), dtype)
    shipped = apply_plan(state, plan)
    assert set(shipped) == set(state) - plan.skip
    assert planned_nbytes(state, plan) == sum(t.numel() * t.element_size() for t in shipped.values())
    for name, t in shipped.items():  # float32 cast to the plan's dtype, nothing else touched
        want = getattr(torch, dtype) if dtype and state[name].dtype == torch.float32 else state[name].dtype
        assert t.dtype == want and torch.equal(t, state[name].to(want))


def _score(engine, rows: list[list[int]]) -> list[list[float]]:
    """Per-position prompt log-probs of `rows` (scoring requests: nothing generated)."""

    async def go():
        reqs = [GenerateRequest(r, SamplingParams(max_new_tokens=0), logprob_start_len=0) for r in rows]
        outs = await asyncio.gather(*(engine.generate(q) for q in reqs))
        return [o.input_logprobs[1:] for o in outs]

    if isinstance(engine, RolloutSide):
        side = engine
        engine = side.engine
        return side._run(go())
    return asyncio.run(go())


def _served_gap(side: RolloutSide, train: TrainSide, rows) -> float:
    """How far the server's log-probs are from an in-process bf16 engine holding the trainer's
    weights (the server holds them exactly when this is ~0)."""
    ref = EmbeddedEngine.from_pretrained(train.model_path, dtype="bfloat16")
    asyncio.run(ref.update_weights_from_tensors(train.bundle.hf_model.state_dict()))
    want, got = _score(ref, rows), _score(side, rows)
    asyncio.run(ref.close())
    return max(abs(a - b) for w, g in zip(want, got, strict=True) for a, b in zip(w, g, strict=True))


@pytest.mark.slow
def test_tensors_over_http_to_a_bf16_server_and_its_restart(tmp_path, tied):
    """verst serve in bf16 gets bf16 bytes; frozen weights go once; a restarted server (from
    other weights) gets everything again."""
    _cfg, train = _train_side(tmp_path, tied)
    other = tied_checkpoint(tmp_path / "other", seed=1)
    rows = [list(range(4, 20)), list(range(30, 44))]
    port = free_port()
    every = set(train.bundle.hf_model.state_dict()) - {HEAD}
    trainable = every - {EMBED}

    def served(model):
        return launch_verst_servers(model, port_base=port, extra_args=["--dtype", "bfloat16"],
                                    ready_timeout_s=180, log_dir=tmp_path / "logs")  # fmt: skip

    with served(tied) as first:
        config = run_dict(tied, tmp_path / "p.jsonl")
        config["engine"] = {"type": "sglang", "urls": first.urls}
        side = RolloutSide(run_config_from_dict(config), model_path=str(tied), env={})
        assert (
            side.engine_capabilities.weight_dtype == "bfloat16" and side.engine_capabilities.partial_weights
        )
        sync = WeightSync(train, side, mode="tensors", staging_dir=tmp_path / "w", dist_info=DistInfo())
        _step(train, 0)
        assert sync.push() == 1 and sync.last_full and sync.last_bytes == _bytes(train, every, itemsize=2)
        _step(train, 1)
        assert sync.push() == 2 and not sync.last_full
        assert sync.last_bytes == _bytes(train, trainable, itemsize=2)
        assert _served_gap(side, train, rows) < 1e-3
    try:
        with served(other):  # the same URL, restarted from other weights, at version 0
            _step(train, 2)
            assert sync.push() == 3 and sync.last_full
            assert _served_gap(side, train, rows) < 1e-3  # the frozen embedding came back too
            _step(train, 3)
            assert sync.push() == 4 and not sync.last_full
            assert _served_gap(side, train, rows) < 1e-3
    finally:
        side.close()
