"""Distributed weight refit end to end: two real `verst serve` subprocesses join one gloo group
with the trainer (rank 0; engines at rank offsets 1 and 2, world size 3) on 127.0.0.1, built
with the same torch helper SGLang's `init_custom_process_group` uses; each push is one SGLang
weight-update session whose parameters go in byte-bounded buckets; both engines then generate
at the new version with log-probs matching the trainer's. The default torch.distributed group is
never initialised on either side. Also: 'distributed' with the in-process engine is a clear
config problem."""

from __future__ import annotations

import pytest
import torch
from test_train_weight_sync import _max_mismatch, _sample_batch, setup  # noqa: F401 (fixture)
from train_testlib import run_dict, write_prompts

from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.engines.pool import EnginePool
from verst.rollout.engines.sglang.client import SGLangClient
from verst.rollout.engines.sglang.launcher import launch_verst_servers
from verst.rollout.errors import ConfigError
from verst.trainer.config import run_config_from_dict, validate_run_config
from verst.trainer.run.rollout_side import RolloutSide
from verst.trainer.sync.weight_sync import WeightSync
from verst.trainer.train.batch import build_train_batch
from verst.trainer.train.fsdp import DistInfo


def test_distributed_sync_to_verst_serve(tmp_path, tiny_checkpoint, setup):  # noqa: F811
    cfg, train = setup
    args = ["--num-threads", "1"]
    with launch_verst_servers(
        tiny_checkpoint, num_servers=2, extra_args=args, ready_timeout_s=180, log_dir=tmp_path / "logs"
    ) as servers:
        clients = [SGLangClient(u) for u in servers.urls]
        served = RolloutSide(cfg, model_path=str(tiny_checkpoint), env={}, engine=EnginePool(clients))
        sync = WeightSync(
            train,
            served,
            mode="distributed",
            staging_dir=tmp_path / "unused",
            dist_info=DistInfo(),
            group_timeout_s=60,
            bucket_bytes=64 << 10,  # several buckets for the tiny model
        )
        try:
            assert sync.mode == "distributed" and sync.group is None
            before = _sample_batch(served, 0)
            assert _max_mismatch(train, before) < 1e-4
            train.train_step(build_train_batch(before))
            assert _max_mismatch(train, before) > 1e-3  # the policy moved

            state = train.state_dict_for_sync()
            assert sum(t.numel() * t.element_size() for t in state.values()) > 3 * (64 << 10)
            assert sync.push() == 1
            assert sync.group is not None and sync.group.backend == "gloo"
            assert sync.group.world_size == 3  # 1 trainer + 2 single-GPU engines
            assert not torch.distributed.is_initialized()  # the default group is untouched
            assert served.weight_version() == 1
            assert [served._run(c.get_weight_version()) for c in clients] == [1, 1]
            after = _sample_batch(served, 1)
            mismatch = _max_mismatch(train, after)
            assert mismatch < 1e-4, f"served log-probs differ from the trainer's by {mismatch}"

            # a second push reuses the group
            group = sync.group
            train.train_step(build_train_batch(after))
            assert sync.push() == 2 and sync.group is group
            assert _max_mismatch(train, _sample_batch(served, 2)) < 1e-4
            assert not (tmp_path / "unused").exists()  # nothing went through the disk
        finally:
            sync.close()
            served.close()


def test_distributed_needs_an_out_of_process_engine(tmp_path, tiny_checkpoint, setup):  # noqa: F811
    cfg, train = setup
    data = write_prompts(tmp_path / "q.jsonl", n=4)
    bad = run_config_from_dict(run_dict(tiny_checkpoint, data, train={"weight_sync": "distributed"}))
    assert bad.engine.type == "embedded"
    with pytest.raises(ConfigError) as err:
        validate_run_config(bad, {}, cuda_available=False)
    assert any(p.key == "train.weight_sync" and "embedded" in p.fix for p in err.value.problems)

    embedded = RolloutSide(
        cfg, model_path=str(tiny_checkpoint), env={}, engine=EmbeddedEngine.from_pretrained(tiny_checkpoint)
    )
    try:
        with pytest.raises(ConfigError, match=r"train\.weight_sync"):
            WeightSync(train, embedded, mode="distributed", staging_dir=tmp_path, dist_info=DistInfo())
    finally:
        embedded.close()


def test_nccl_refused_when_trainer_and_engine_share_a_gpu(tmp_path, tiny_checkpoint, setup):  # noqa: F811
    """NCCL rejects two ranks on one device: refused up front with the fix, before any rendezvous."""
    from types import SimpleNamespace

    from verst.rollout.engine import engine_capabilities
    from verst.trainer.sync.weight_sync import WeightSyncError

    _, train = setup
    client = SGLangClient("http://127.0.0.1:9")  # never contacted: the refusal comes first
    side = SimpleNamespace(engine=client, engine_capabilities=engine_capabilities(client), submit=None)
    sync = WeightSync(
        train, side, mode="distributed", staging_dir=tmp_path, dist_info=DistInfo(),
        backend="nccl", shares_gpu_with_engine=True,
    )  # fmt: skip
    with pytest.raises(WeightSyncError, match=r"different GPUs.*'disk' or 'tensors'"):
        sync.push()
    assert sync.group is None
