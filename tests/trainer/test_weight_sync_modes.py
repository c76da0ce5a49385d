"""Weight-sync modes are a variant table: `train.weight_sync` takes a name or a table with the
mode's own options, the flat key of earlier configs still loads, a mode from an import path syncs
a real engine, and what the engine's capabilities rule out is the mode's own config error."""

from __future__ import annotations

import pytest
from pydantic import Field
from test_train_weight_sync import _max_mismatch, _sample_batch, setup  # noqa: F401 (fixture)

from verst.rollout.engine import EngineCapabilities
from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.errors import ConfigError, Problem
from verst.trainer.config import RunConfig, load_run_config
from verst.trainer.run.rollout_side import RolloutSide
from verst.trainer.sync.modes import (
    DiskSyncConfig,
    DistributedSyncConfig,
    SyncContext,
    WeightSyncSection,
)
from verst.trainer.sync.weight_sync import WeightSync
from verst.trainer.train.batch import build_train_batch
from verst.trainer.train.fsdp import DistInfo

MODE_TYPE = f"{__name__}:ShelfSync"


class ShelfSync:
    """A mode written here: each version goes to `<staging>/<shelf>/v<N>`, and the last
    `keep` versions stay on disk (the built-in disk mode keeps one)."""

    class Config(WeightSyncSection):
        type: str = Field(MODE_TYPE, description="This mode's import path.")
        shelf: str = Field("shelf", description="Folder under the staging directory.")
        keep: int = Field(2, ge=1, description="Versions kept on disk.")

        def problems(self, key: str, caps: EngineCapabilities, engine: str) -> list[Problem]:
            if "disk" in caps.weight_sync:
                return []
            return [
                Problem(key, f"{engine} cannot load a checkpoint directory", f"use {caps.weight_sync[0]!r}")
            ]

        def build(self, context: SyncContext) -> ShelfSync:
            return ShelfSync(self, context)

    def __init__(self, config: ShelfSync.Config, context: SyncContext) -> None:
        self.root = context.staging_dir / config.shelf
        self.train = context.train
        self.keep = config.keep

    def push(self, rollout, state, version):
        import shutil

        path = self.root / f"v{version}"
        self.train.save_hf(path, state)
        got = rollout.update_weights_from_disk(str(path), version)
        for old in sorted(self.root.iterdir(), key=lambda p: int(p.name[1:]))[: -self.keep]:
            shutil.rmtree(old)
        return got

    def close(self) -> None:
        pass


def test_names_tables_and_the_flat_key_of_earlier_configs(tmp_path):
    def train(**fields):
        return RunConfig.model_validate({"train": {"model_path": "/m", **fields}}).train.weight_sync

    assert type(train()).__name__ == "AutoSyncConfig"
    assert isinstance(train(weight_sync="disk"), DiskSyncConfig)
    mode = train(weight_sync={"type": "distributed", "master_address": "10.0.0.2", "bucket_bytes": 1024})
    assert isinstance(mode, DistributedSyncConfig) and (mode.master_address, mode.bucket_bytes) == (
        "10.0.0.2",
        1024,
    )
    # the flat key of earlier configs moves into the distributed table (ignored by other modes, as before)
    old = train(weight_sync="distributed", weight_sync_master_address="10.0.0.3")
    assert isinstance(old, DistributedSyncConfig) and old.master_address == "10.0.0.3"
    assert isinstance(train(weight_sync="disk", weight_sync_master_address="10.0.0.3"), DiskSyncConfig)
    # a written config loads back; a mode's own keys are validated where they are
    cfg = RunConfig.model_validate({"train": {"model_path": "/m", "weight_sync": mode.model_dump()}})
    assert cfg.train.weight_sync == mode
    path = tmp_path / "run.toml"
    path.write_text('[train]\nmodel_path = "/m"\nweight_sync = "disk"\n', encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_run_config(path, ['train.weight_sync={type = "distributed", bucket_byte = 1}'])
    assert info.value.problems[0].key == "train.weight_sync.bucket_byte"
    with pytest.raises(ConfigError) as info:
        load_run_config(path, ["train.weight_sync=nccl"])
    assert (
        info.value.problems[0].key == "train.weight_sync.type"
        and "'distributed'" in info.value.problems[0].why
    )


def test_a_mode_from_an_import_path_syncs_the_engine(tmp_path, tiny_checkpoint, setup):  # noqa: F811
    cfg, train = setup
    side = RolloutSide(
        cfg, model_path=str(tiny_checkpoint), env={}, engine=EmbeddedEngine.from_pretrained(tiny_checkpoint)
    )
    try:
        sync = WeightSync(
            train, side, mode={"type": MODE_TYPE, "keep": 1}, staging_dir=tmp_path / "w", dist_info=DistInfo()
        )
        assert sync.mode == MODE_TYPE
        train.train_step(build_train_batch(_sample_batch(side, 0)))  # the policy moves
        assert sync.push() == 1 and sync.push() == 2
        assert [p.name for p in (tmp_path / "w" / "shelf").iterdir()] == ["v2"]
        assert _max_mismatch(train, _sample_batch(side, 2)) < 1e-4  # the engine holds the new weights
        # what the engine's capabilities rule out is the mode's own problem, before anything is sent
        side.engine_capabilities = EngineCapabilities(in_process=True, weight_sync=("tensors",))
        with pytest.raises(ConfigError, match="cannot load a checkpoint directory"):
            WeightSync(train, side, mode=MODE_TYPE, staging_dir=tmp_path / "w", dist_info=DistInfo())
        side.engine_capabilities = EngineCapabilities(in_process=True, weight_sync=("tensors", "disk"))
        with pytest.raises(ConfigError, match=r"'distributed' broadcasts.*accepts tensors, disk"):
            WeightSync(train, side, mode="distributed", staging_dir=tmp_path / "w", dist_info=DistInfo())
    finally:
        side.close()
