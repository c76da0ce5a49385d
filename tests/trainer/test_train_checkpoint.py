"""Checkpoints are atomic: a crash mid-write leaves the previous checkpoint as the latest."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from verst.trainer.run.checkpoint import (
    capture_rng,
    latest_checkpoint,
    list_checkpoints,
    read_meta,
    restore_rng,
    save_checkpoint,
)
from verst.trainer.run.signals import StopRequest


def _write_files(n: int):
    def write(d: Path) -> None:
        for i in range(n):
            (d / f"part{i}.bin").write_bytes(os.urandom(1024))

    return write


def _crash_mid_write(root: str) -> None:
    def write(d: Path) -> None:
        (d / "part0.bin").write_bytes(b"x" * 4096)
        os.kill(os.getpid(), signal.SIGKILL)  # the process dies with the checkpoint half written

    save_checkpoint(root, 2, write, {"weight_version": 2})


def test_crash_mid_write_keeps_previous_latest(tmp_path):
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, _write_files(2), {"weight_version": 1})
    proc = mp.get_context("fork").Process(target=_crash_mid_write, args=(str(root),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    assert (root / "step_2.tmp").is_dir()  # the half-written one is there...
    assert latest_checkpoint(root) == root / "step_1"  # ...but never chosen
    assert read_meta(root / "step_1")["weight_version"] == 1
    # the next save of that step replaces the stale temp folder
    save_checkpoint(root, 2, _write_files(1), {"weight_version": 2})
    assert latest_checkpoint(root) == root / "step_2" and not (root / "step_2.tmp").exists()


def test_exception_mid_write_keeps_previous_latest(tmp_path):
    root = tmp_path / "ckpt"
    save_checkpoint(root, 3, _write_files(1), {})

    def boom(d: Path) -> None:
        (d / "a").write_text("partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(root, 4, boom, {})
    assert latest_checkpoint(root) == root / "step_3"


def test_folder_without_meta_is_ignored_and_pruning_keeps_newest(tmp_path):
    root = tmp_path / "ckpt"
    for step in (1, 2, 10):
        save_checkpoint(root, step, _write_files(1), {}, keep=2)
    (root / "step_99").mkdir()  # no meta.json: incomplete
    assert [s for s, _ in list_checkpoints(root)] == [2, 10]
    (root / "step_11.tmp").mkdir()  # a crash leftover: pruned by the next save
    save_checkpoint(root, 12, _write_files(1), {}, keep=2)
    assert [s for s, _ in list_checkpoints(root)] == [10, 12] and not (root / "step_11.tmp").exists()
    shutil.rmtree(root / "step_12")
    assert latest_checkpoint(root) == root / "step_10"
    assert latest_checkpoint(tmp_path / "nothing") is None


def test_rng_round_trip():
    state = capture_rng()
    a = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    restore_rng(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == a


def test_stop_request_on_sigterm_then_restores_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before
