"""A run's first generate uses exactly the trainer's weights, whatever the engine held before
(issue 39, item 1): a second run against a `verst serve` another run has refitted, and a resume
against a server an unrelated run has refitted, sample what a run against a fresh server samples,
labelled with the trainer's weight versions. The same for an embedded engine handed to two runs.

Real parts: `verst serve` subprocesses on loopback (the tiny model), the trainer, `run_training`;
the samples are read back from each run's `trajectories.jsonl`.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from train_testlib import run_dict, write_prompts

from verst.rollout.engines.embedded.engine import EmbeddedEngine
from verst.rollout.engines.sglang.launcher import launch_verst_servers
from verst.trainer.config import run_config_from_dict
from verst.trainer.dashboard.trajectories import read_trajectories
from verst.trainer.run.controller import run_training

pytestmark = pytest.mark.timeout(240)

OTHER_DATA_SEED = 11
"""The other run's prompt order: other samples, so its refitted weights differ."""


@pytest.fixture(scope="module")
def servers(tiny_checkpoint, tmp_path_factory):
    """Three fresh `verst serve`s: the one other runs touch, and two references."""
    logs = tmp_path_factory.mktemp("serve-logs")
    with launch_verst_servers(
        tiny_checkpoint, num_servers=3, extra_args=["--num-threads", "1"], ready_timeout_s=180, log_dir=logs
    ) as launched:
        yield launched.urls


def _config(tmp_path, model, engine, *, steps, resume=False, data_seed=3):
    data = write_prompts(tmp_path / "p.jsonl", n=8)
    table = run_dict(
        model,
        data,
        run={"num_steps": steps, "resume": resume, "record": {"trajectories_per_step": 64}},
        train={"lr": 5e-2},
        rollout={"data": {"path": str(data), "seed": data_seed}},
    )
    if engine is not None:
        table["engine"] = engine
    return run_config_from_dict(table)


def _train(tmp_path, model, run_dir, engine=None, *, steps=1, resume=False, data_seed=3, given=None):
    torch.set_num_threads(1)
    cfg = _config(tmp_path, model, engine, steps=steps, resume=resume, data_seed=data_seed)
    return run_training(cfg, run_dir, env={}, engine=given)


def _samples(run_dir, step):
    """(sample index → tokens, engine log-probs, weight versions) of one step's training rollout."""
    rows = read_trajectories(run_dir, step=step, split="train")
    return {r["sample_index"]: (r["tokens"], r["rollout_logprobs"], r["weight_versions"]) for r in rows}


def _assert_same(got, want, version):
    assert got and set(got) == set(want)
    for index, (tokens, logprobs, versions) in want.items():
        g_tokens, g_logprobs, g_versions = got[index]
        assert g_versions == versions == [version], f"sample {index}: weight versions {g_versions}"
        assert g_tokens == tokens, f"sample {index}: other tokens (another policy generated them)"
        assert max(abs(a - b) for a, b in zip(g_logprobs, logprobs, strict=True)) < 1e-4


def _sglang(url):
    return {"type": "sglang", "urls": [url]}


def test_a_second_run_and_a_resume_against_a_refitted_server_sample_like_a_fresh_one(
    tmp_path, tiny_checkpoint, servers
):
    touched, fresh, fresh_too = servers
    # an unrelated run refits `touched` (its version 2 holds that run's trained weights)
    _train(
        tmp_path,
        tiny_checkpoint,
        tmp_path / "unrelated",
        _sglang(touched),
        steps=2,
        data_seed=OTHER_DATA_SEED,
    )

    # the reference: a run against a fresh server; a copy of it resumes against another fresh one
    _train(tmp_path, tiny_checkpoint, tmp_path / "ref", _sglang(fresh))
    shutil.copytree(tmp_path / "ref", tmp_path / "ref_copy")
    _train(tmp_path, tiny_checkpoint, tmp_path / "ref_copy", _sglang(fresh_too), steps=2, resume=True)

    # a resume of the same checkpoint against the touched server (at the unrelated run's version 2)
    shutil.copytree(tmp_path / "ref", tmp_path / "resumed")
    _train(tmp_path, tiny_checkpoint, tmp_path / "resumed", _sglang(touched), steps=2, resume=True)
    _assert_same(_samples(tmp_path / "resumed", 2), _samples(tmp_path / "ref_copy", 2), version=1)

    # a fresh run against the touched server (now holding the resumed run's version 2)
    _train(tmp_path, tiny_checkpoint, tmp_path / "second", _sglang(touched))
    _assert_same(_samples(tmp_path / "second", 1), _samples(tmp_path / "ref", 1), version=0)


def test_an_embedded_engine_handed_to_a_second_run_gets_its_weights(tmp_path, tiny_checkpoint):
    engine = EmbeddedEngine.from_pretrained(tiny_checkpoint)
    try:
        _train(tmp_path, tiny_checkpoint, tmp_path / "first", given=engine, data_seed=OTHER_DATA_SEED)
        _train(tmp_path, tiny_checkpoint, tmp_path / "second", given=engine)
    finally:
        import asyncio

        asyncio.run(engine.close())
    _train(tmp_path, tiny_checkpoint, tmp_path / "built")  # [engine] embedded, built by the run
    _assert_same(_samples(tmp_path / "second", 1), _samples(tmp_path / "built", 1), version=0)
