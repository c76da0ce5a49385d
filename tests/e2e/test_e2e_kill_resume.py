"""Kill-anywhere resume (issue 39 item 6): `verst train` SIGKILLed at seeded moments — during
rollout, train, weight sync, eval and checkpoint write (mid-write included) — and resumed each
time, ends bit-equal to an uninterrupted run: the same final weights (every tensor), the same
prompts and rewards at every step.

Runs go through `kill_testlib.KillServer` (one pre-imported process forking a real CLI child per
run). The embedded engine with seeded requests is deterministic, so everything is compared
exactly. More kill points, and random-time kills, run under `-m slow`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from kill_testlib import Kill, KillServer
from safetensors.torch import load_file

from verst.trainer.run.checkpoint import latest_checkpoint

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reverse_digits"
STEPS = 5
EVAL_EVERY = 2


def _argv(run_dir: Path, eval_file: Path) -> list[str]:
    return [
        "train", str(EXAMPLE / "config.toml"),
        f'run.output_dir="{run_dir}"', f"run.num_steps={STEPS}", "run.save_interval=1",
        "run.keep_checkpoints=2", "run.resume=true",
        f"rollout.eval.interval={EVAL_EVERY}", f'rollout.eval.datasets.heldout.path="{eval_file}"',
        "rollout.batch_size=4", "rollout.n_samples_per_prompt=4",
        "train.micro_batch_size=16", "train.num_threads=1",
    ]  # fmt: skip


def _points(rng: random.Random) -> list[Kill]:
    """Every phase of every step, in the order a run reaches them, each after a seeded delay
    (0-40 ms: a checkpoint write is often caught half written)."""
    out = [Kill("eval", -1, rng.uniform(0, 0.04))]
    for step in range(STEPS):
        phases = ["rollout", "train", "sync"]
        if (step + 1) % EVAL_EVERY == 0:
            phases.append("eval")
        out += [Kill(p, step, rng.uniform(0, 0.04)) for p in [*phases, "checkpoint"]]
    return out


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert ckpt is not None
    out: dict[str, torch.Tensor] = {}
    for f in sorted((ckpt / "model").glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _per_step(run_dir: Path) -> tuple[dict, dict]:
    """Each train step's (last recorded) reward mean, and its samples' (prompt, response, reward)
    in sample order; a step a kill cut short and the resume redid counts once, as redone."""
    rewards = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "rollout/reward_mean" in row:
            rewards[row["step"]] = row["rollout/reward_mean"]
    samples: dict[tuple[int, int], tuple] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["split"] == "train":
            samples[(row["step"], row["sample_index"])] = (row["prompt"], row["response"], row["reward"])
    by_step: dict[int, list] = {}
    for (step, index), value in sorted(samples.items()):
        by_step.setdefault(step, []).append((index, value))
    return rewards, by_step


@pytest.fixture(scope="module")
def server():
    s = KillServer()
    yield s
    s.close()


@pytest.fixture()
def eval_file(tmp_path: Path) -> Path:
    path = tmp_path / "eval.jsonl"
    path.write_text("\n".join((EXAMPLE / "data" / "eval.jsonl").read_text().splitlines()[:8]) + "\n")
    return path


def _chain(server: KillServer, run_dir: Path, eval_file: Path, kills: list[Kill]) -> int:
    """Run with each kill in turn (each run resuming the last), then to the end; the kills that
    landed."""
    landed = 0
    for kill in kills:
        out = server.run(_argv(run_dir, eval_file), run_dir, kill)
        if out["signal"] == 9:
            landed += 1
        else:
            assert out["code"] == 0, (kill, (run_dir.parent / f"{run_dir.name}.log").read_text()[-3000:])
            break  # the run finished before this point: nothing left to kill
    final = server.run(_argv(run_dir, eval_file), run_dir)
    assert final["code"] == 0, (run_dir.parent / f"{run_dir.name}.log").read_text()[-3000:]
    return landed


def _assert_same_run(straight: Path, resumed: Path) -> None:
    w_straight, w_resumed = _weights(straight), _weights(resumed)
    assert w_straight.keys() == w_resumed.keys()
    differ = [k for k in w_straight if not torch.equal(w_straight[k], w_resumed[k])]
    assert not differ, f"tensors differ after kill/resume: {differ[:5]}"
    r_straight, s_straight = _per_step(straight)
    r_resumed, s_resumed = _per_step(resumed)
    assert sorted(r_straight) == list(range(1, STEPS + 1))
    assert r_resumed == r_straight
    assert s_resumed == s_straight  # every step's prompts, responses and rewards: none skipped or twice


@pytest.mark.timeout(600)
def test_sigkill_at_every_phase_then_resume_equals_an_uninterrupted_run(server, tmp_path, eval_file):
    straight = tmp_path / "straight"
    assert server.run(_argv(straight, eval_file), straight)["code"] == 0
    kills = _points(random.Random(0))
    assert len(kills) >= 20
    resumed = tmp_path / "resumed"
    landed = _chain(server, resumed, eval_file, kills)
    assert landed >= 20, f"only {landed} of {len(kills)} kills landed"
    _assert_same_run(straight, resumed)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_at_random_moments_then_resume_equals_an_uninterrupted_run(server, tmp_path, eval_file, seed):
    straight = tmp_path / "straight"
    assert server.run(_argv(straight, eval_file), straight)["code"] == 0
    rng = random.Random(seed)
    kills = _points(rng) + [Kill(after_s=rng.uniform(0.5, 4.0)) for _ in range(10)]
    resumed = tmp_path / "resumed"
    _chain(server, resumed, eval_file, kills)
    _assert_same_run(straight, resumed)
