"""A run whose engine dies, is unreachable or is stopped mid-rollout ends in seconds, with one
clear error (or a clean stop), a checkpoint holding every prompt in play, and a non-zero exit.

Real parts: a `verst serve` subprocess on loopback (tiny model), the trainer, the CLI entry
point. The server is killed with SIGKILL (a fault); SIGTERM is a real signal to this process.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from run_testlib import OnPhase
from train_testlib_e2e import run_config

from verst.rollout.engines.sglang.launcher import launch_verst_servers
from verst.rollout.errors import EngineUnavailableError, RolloutFailedError
from verst.trainer.cli import EXIT_ROLLOUT_FAILED, main
from verst.trainer.run.checkpoint import latest_checkpoint
from verst.trainer.run.controller import run_training

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reverse_digits"

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    """Two `verst serve`s (the trainer's, and one for the server's own SIGTERM test); every request
    waits ~0.4 s (so a rollout is in flight long enough)."""
    extra = ["--num-threads", "1", "--inject-latency-ms", "400", "--inject-latency-fraction", "1.0"]
    logs = tmp_path_factory.mktemp("serve-logs")
    with launch_verst_servers(tiny_checkpoint, num_servers=2, extra_args=extra, log_dir=logs) as launched:
        yield launched


def buffered_prompts(run_dir: Path) -> int:
    state = torch.load(latest_checkpoint(run_dir / "checkpoints") / "run_state.pt", weights_only=False)
    return len(state["rollout"]["data_source"]["buffer"])


def test_unreachable_engine_is_found_before_the_first_rollout(tmp_path, tiny_checkpoint, monkeypatch):
    cfg = run_config(tmp_path, tiny_checkpoint, monkeypatch, engine={"type": "sglang", "urls": ["not a url"]})
    start = time.monotonic()
    with pytest.raises(EngineUnavailableError, match=r"not a url.*health check") as info:
        run_training(cfg, tmp_path / "run", env={})
    assert time.monotonic() - start < 10, "a malformed URL must fail at once, not after the health wait"
    assert "verst serve" in str(info.value)


def test_sigterm_during_a_rollout_stops_within_seconds_with_a_checkpoint(
    tmp_path, tiny_checkpoint, monkeypatch, server
):
    cfg = run_config(
        tmp_path,
        tiny_checkpoint,
        monkeypatch,
        run={"num_steps": 5},
        engine={"type": "sglang", "urls": server.urls[:1]},
    )
    logger = OnPhase("rollout", 1, lambda: os.kill(os.getpid(), signal.SIGTERM))
    summary = run_training(cfg, tmp_path / "run", env={}, logger=logger)
    assert time.monotonic() - logger.fired_at < 10, "the stop did not wait for the rollout to end"
    assert summary.stopped_early and summary.steps_done == 1
    assert summary.checkpoint is not None and summary.checkpoint.name == "step_1"
    assert buffered_prompts(tmp_path / "run") == 2, "the interrupted rollout's groups were handed back"


HUGE_QUEUE = (6, 4096)
"""Requests × sequences each of the SIGTERM test: 24,576 queued rows, the most six requests may
hold under the default bounds. Before the one-wake-up abort (issue 25, item 7) this server
took > 8 s to exit (see the note of issue 25)."""


def _queued(url: str) -> int:
    with urllib.request.urlopen(f"{url}/v1/loads", timeout=10) as resp:
        load = json.load(resp)["loads"][0]
    return load["num_running_reqs"] + load["num_waiting_reqs"]


def test_sigterm_on_a_verst_serve_with_a_huge_queue_answers_every_request_and_exits_in_seconds(server):
    proc, url = server.servers[1].process, server.servers[1].url
    clients_n, n = HUGE_QUEUE
    body = {"input_ids": [1, 2, 3], "sampling_params": {"n": n, "max_new_tokens": 240, "ignore_eos": True}}
    answers: list[object] = []

    def call() -> None:
        try:
            req = urllib.request.Request(f"{url}/generate", json.dumps(body).encode(), method="POST")
            with urllib.request.urlopen(req, timeout=90) as resp:
                answers.append((resp.status, json.load(resp)))
        except Exception as exc:  # a dropped connection: the test fails on it below
            answers.append(f"{type(exc).__name__}: {exc}")

    clients = [threading.Thread(target=call) for _ in range(clients_n)]
    for t in clients:
        t.start()
    deadline = time.monotonic() + 60
    while _queued(url) < clients_n * n:  # every sequence is in the engine (queued or running)
        assert time.monotonic() < deadline, f"only {_queued(url)} of {clients_n * n} sequences were queued"
        time.sleep(0.1)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    took = time.monotonic() - start
    assert took < 8, f"SIGTERM with {clients_n * n} queued sequences took {took:.1f} s to exit"
    for t in clients:
        t.join(30)
    assert len(answers) == clients_n, "a client still waits for its answer"
    finishes = []
    for answer in answers:
        assert isinstance(answer, tuple), f"an accepted request got no answer: {answer}"
        status, items = answer
        assert status == 200 and len(items) == n
        finishes += [item["meta_info"]["finish_reason"]["type"] for item in items]
    assert set(finishes) <= {"abort", "length"}
    assert finishes.count("abort") >= clients_n * n - 1024, "the queued sequences were not aborted"


def test_engine_killed_mid_run_stops_with_a_clear_error_and_a_checkpoint(
    tmp_path, tiny_checkpoint, monkeypatch, server
):
    cfg = run_config(
        tmp_path,
        tiny_checkpoint,
        monkeypatch,
        run={"num_steps": 50},
        engine={"type": "sglang", "urls": server.urls[:1], "max_retries": 1, "backoff_s": 0.05},
        rollout={"max_group_retries": 0},
    )
    victim = server.servers[0].process
    logger = OnPhase("rollout", 1, lambda: victim.send_signal(signal.SIGKILL), delay_s=0.1)
    with pytest.raises(RolloutFailedError, match=r"groups in a row failed.*127\.0\.0\.1") as info:
        run_training(cfg, tmp_path / "run", env={}, logger=logger)
    assert time.monotonic() - logger.fired_at < 30
    assert "SGLangClient" in str(info.value)
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert ckpt is not None and ckpt.name == "step_1"
    assert buffered_prompts(tmp_path / "run") >= 3, "every failed prompt was handed back"


def test_verst_train_with_a_reward_that_always_raises_exits_non_zero_with_a_checkpoint(
    tmp_path, monkeypatch, capsys
):
    (tmp_path / "e2e_bad_reward.py").write_text(
        "def always_raises(sample):\n    raise KeyError('no field answer in the sample')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    code = main(
        [
            "train",
            str(EXAMPLE / "config.toml"),
            f'run.output_dir="{run}"',
            "run.num_steps=3",
            'rollout.reward.type="e2e_bad_reward:always_raises"',
            "rollout.eval.datasets={}",
            "rollout.batch_size=2",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_response_len=4",
        ]
    )
    err = capsys.readouterr().err
    assert code == EXIT_ROLLOUT_FAILED, err
    assert "RolloutFailedError" in err and "reward: " in err and "KeyError: 'no field answer" in err
    assert "e2e_bad_reward:always_raises" in err, "the message names the function"
    ckpt = latest_checkpoint(run / "checkpoints")
    assert ckpt is not None and buffered_prompts(run) >= 1
