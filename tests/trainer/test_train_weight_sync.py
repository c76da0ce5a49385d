"""Weight sync round trip: after a train step, the embedded engine (in-process tensors) and a
`verst serve` engine (HTTP, from disk — and from serialized tensors — through the SGLang
client) both generate with the new weights; the version is checked and their log-probs match
the trainer's."""

from __future__ import annotations

import asyncio

import pytest
import torch
from train_testlib import run_dict, write_prompts

from verst.rollout.engine import GenerateRequest, SamplingParams
from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.engines.sglang.client import SGLangClient
from verst.rollout.engines.sglang.launcher import launch_verst_servers
from verst.rollout.sample import Sample, Status
from verst.trainer.config import run_config_from_dict
from verst.trainer.run.rollout_side import RolloutSide
from verst.trainer.sync.weight_sync import WeightSync, WeightSyncError
from verst.trainer.train.batch import build_train_batch
from verst.trainer.train.fsdp import DistInfo
from verst.trainer.train.side import TrainSide

PROMPTS = ["12+3=", "7+70=", "(5)"]


def _sample_batch(side: RolloutSide, weight_version: int, lora_path: str | None = None) -> list[list[Sample]]:
    """Generate a few samples through a rollout side's engine (a group per prompt), with the
    adapter `lora_path` when given."""

    async def go():
        groups = []
        for g, prompt in enumerate(PROMPTS):
            ids = side.tokenizer(prompt)["input_ids"]
            reqs = [
                GenerateRequest(
                    ids, SamplingParams(max_new_tokens=8, sampling_seed=100 * g + j), lora_path=lora_path
                )
                for j in range(3)
            ]
            outs = await asyncio.gather(*(side.engine.generate(r) for r in reqs))
            group = []
            for j, o in enumerate(outs):
                assert o.weight_version == weight_version
                group.append(
                    Sample(
                        prompt=prompt,
                        tokens=ids + o.output_ids,
                        response_length=len(o.output_ids),
                        rollout_logprobs=o.output_logprobs,
                        reward=float(j == g % 3),
                        status=Status.COMPLETED,
                        weight_versions=[o.weight_version],
                        group_index=g,
                        sample_index=3 * g + j,
                    )
                )
            groups.append(group)
        return groups

    return side._run(go())


def _max_mismatch(train: TrainSide, groups: list[list[Sample]]) -> float:
    batch = build_train_batch(groups)
    ours = train.compute_old_logprobs(batch)
    return float(((ours - batch.rollout_logprobs).abs() * batch.loss_mask).max())


@pytest.fixture()
def setup(tmp_path, tiny_checkpoint):
    torch.set_num_threads(1)
    data = write_prompts(tmp_path / "p.jsonl", n=4)
    cfg = run_config_from_dict(run_dict(tiny_checkpoint, data, train={"lr": 3e-2}))
    train = TrainSide(
        cfg.train,
        cfg.algorithm,
        model_path=str(tiny_checkpoint),
        total_steps=2,
        max_response_len=8,
        temperature=1.0,
        env={},
    )
    return cfg, train


def test_sync_to_embedded_and_verst_serve(tmp_path, tiny_checkpoint, setup):
    cfg, train = setup
    embedded = RolloutSide(
        cfg, model_path=str(tiny_checkpoint), env={}, engine=EmbeddedEngine.from_pretrained(tiny_checkpoint)
    )
    with launch_verst_servers(tiny_checkpoint, ready_timeout_s=180, log_dir=tmp_path / "logs") as servers:
        served = RolloutSide(
            cfg, model_path=str(tiny_checkpoint), env={}, engine=SGLangClient(servers.urls[0])
        )
        try:
            syncs = [
                WeightSync(
                    train, embedded, mode="auto", staging_dir=tmp_path / "w_embedded", dist_info=DistInfo()
                ),
                WeightSync(
                    train, served, mode="auto", staging_dir=tmp_path / "w_served", dist_info=DistInfo()
                ),
            ]
            assert [s.mode for s in syncs] == ["tensors", "disk"]

            before = _sample_batch(embedded, 0)
            assert _max_mismatch(train, before) < 1e-4
            train.train_step(build_train_batch(before))  # the policy moves
            assert _max_mismatch(train, before) > 1e-3  # (old samples no longer match the new policy)

            for sync in syncs:
                assert sync.push() == 1
            for side in (embedded, served):
                assert side.weight_version() == 1
                after = _sample_batch(side, 1)  # responses carry version 1
                assert all(s.weight_versions == [1] for g in after for s in g)
                mismatch = _max_mismatch(train, after)
                assert mismatch < 1e-4, (
                    f"{side.engine!r}: engine log-probs differ from the trainer's by {mismatch}"
                )
            # disk staging keeps only the current version
            assert [p.name for p in (tmp_path / "w_served").iterdir()] == ["v1"]
            train.train_step(build_train_batch(_sample_batch(served, 1)))
            assert syncs[1].push() == 2 and not (tmp_path / "w_served" / "v1").exists()

            # SGLang's from-tensor contract over HTTP (CPU tensors serialized by value)
            train.train_step(build_train_batch(_sample_batch(served, 2)))
            by_tensor = WeightSync(
                train,
                served,
                mode="tensors",
                staging_dir=tmp_path / "x",
                dist_info=DistInfo(),
                weight_version=2,
            )
            assert by_tensor.push() == 3 and served.weight_version() == 3
            assert _max_mismatch(train, _sample_batch(served, 3)) < 1e-4

            # an engine that reports another version than the one pushed is an error
            embedded.update_weights_from_tensors(train.state_dict_for_sync(), 7)
            bad = WeightSync(
                train, embedded, mode="tensors", staging_dir=tmp_path / "x", dist_info=DistInfo()
            )
            bad.rollout = _Lying(embedded)
            with pytest.raises(WeightSyncError, match="version"):
                bad.push()
        finally:
            served.close()
            embedded.close()


class _Lying:
    """A rollout side whose engine ignores the requested version (fault injection)."""

    in_process_engine = True

    def __init__(self, side: RolloutSide) -> None:
        self.side = side

    def update_weights_from_tensors(self, named, weight_version):
        return self.side.update_weights_from_tensors(named, weight_version + 5)

    def update_weights_from_disk(self, path, weight_version):  # pragma: no cover - unused
        raise AssertionError
