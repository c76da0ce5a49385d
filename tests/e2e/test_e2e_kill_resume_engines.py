"""Kill-anywhere resume beyond the embedded engine (issue 39 item 6): `verst train` SIGKILLed at
seeded moments with a `verst serve` engine, and fully-async with partial rollout, then resumed.

These runs are not bit-deterministic (requests reach the engine with the timing of the moment;
the fully-async producer races the trainer), so what is checked is what must hold anyway:

* every step is trained exactly once, on `batch_size` groups, the last attempt of a step counting;
* **no prompt trained twice, none skipped**: the prompts trained over the whole run, plus the
  groups the final checkpoint holds (the strategy's buffer and in-flight prompts, the data
  source's handed-back prompts) are exactly the first `offset` prompts of the data source's
  shuffled order, each once;
* with `verst serve` (the synchronous strategy) every step trains the same prompts as an
  uninterrupted run.

Runs go through `kill_testlib.KillServer` (the real CLI in forked children). A handful of kill
points per scenario run by default, more under `-m slow`; the embedded-engine test
(test_e2e_kill_resume.py) holds the 23 bit-equal ones.
"""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from kill_testlib import Kill, KillServer

from verst.rollout.engines.sglang.launcher import launch_verst_servers
from verst.trainer.run.checkpoint import latest_checkpoint

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reverse_digits"
STEPS = 4
BATCH = 4
N = 4


def _argv(run_dir: Path, eval_file: Path, extra: list[str]) -> list[str]:
    return [
        "train", str(EXAMPLE / "config.toml"),
        f'run.output_dir="{run_dir}"', f"run.num_steps={STEPS}", "run.save_interval=1",
        "run.keep_checkpoints=2", "run.resume=true",
        "rollout.eval.interval=2", f'rollout.eval.datasets.heldout.path="{eval_file}"',
        f"rollout.batch_size={BATCH}", f"rollout.n_samples_per_prompt={N}",
        "train.micro_batch_size=16", "train.num_threads=1", *extra,
    ]  # fmt: skip


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _chain(server: KillServer, run_dir: Path, argv: list[str], kills: list[Kill]) -> tuple[int, list[int]]:
    """Each kill in turn (each run resuming the last), then a run to the end; the kills that
    landed, and where each attempt's lines start in samples.jsonl."""
    starts, landed = [], 0
    for kill in [*kills, None]:
        starts.append(_lines(run_dir / "samples.jsonl"))
        out = server.run(argv, run_dir, kill)
        log = (run_dir.parent / f"{run_dir.name}.log").read_text()[-3000:]
        if kill is not None and out["signal"] == 9:
            landed += 1
            continue
        assert out["code"] == 0, (kill, log)
        if kill is not None:  # finished before this point: nothing left to kill
            starts.append(_lines(run_dir / "samples.jsonl"))
            break
    return landed, starts


def _trained_prompts(run_dir: Path, starts: list[int]) -> dict[int, Counter]:
    """Each train step's prompts (one per group), from the last attempt that logged the step."""
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    by_step: dict[int, Counter] = {}
    bounds = [*starts, len(rows)]
    for begin, end in itertools.pairwise(bounds):
        attempt: dict[int, Counter] = {}
        for row in rows[begin:end]:
            if row["split"] == "train":
                attempt.setdefault(row["step"], Counter())[row["prompt"]] += 1
        by_step.update(attempt)  # a later attempt's step replaces an earlier one's
    out = {}
    for step, prompts in by_step.items():
        assert all(n == N for n in prompts.values()), (step, prompts)  # whole groups only
        out[step] = Counter(prompts.keys())
    return out


def _held(run_dir: Path) -> tuple[Counter, int]:
    """The prompts the final checkpoint still holds, and the data source's offset."""
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert ckpt is not None
    state = torch.load(ckpt / "run_state.pt", weights_only=False)["rollout"]
    source, strategy = state["data_source"], state["strategy"]
    assert source["epoch"] == 0
    held: Counter = Counter()

    def take(groups):
        for group in groups:
            group = group["group"] if isinstance(group, dict) else group
            held[group[0]["prompt"]] += 1

    take(source.get("buffer", []))
    take(strategy.get("buffer", []))
    take(strategy.get("pending", []))
    return held, source["offset"]


def _order() -> list[str]:
    """The data source's epoch-0 order (`PromptDataSource`: file order shuffled with `seed`)."""
    rows = [json.loads(line) for line in (EXAMPLE / "data" / "train.jsonl").read_text().splitlines()]
    order = list(range(len(rows)))
    random.Random(0).shuffle(order)
    return [rows[i]["prompt"] for i in order]


def _assert_conserved(run_dir: Path, starts: list[int]) -> dict[int, Counter]:
    trained = _trained_prompts(run_dir, starts)
    assert sorted(trained) == list(range(1, STEPS + 1))
    assert all(sum(c.values()) == BATCH for c in trained.values()), trained
    total = sum(trained.values(), Counter())
    twice = [p for p, n in total.items() if n > 1]
    assert not twice, f"trained twice: {twice}"
    held, offset = _held(run_dir)
    taken = Counter(_order()[:offset])
    everything = total + held
    assert everything == taken, (
        f"skipped: {sorted(taken - everything)}; extra or twice: {sorted(everything - taken)}"
    )
    return trained


def _kills(rng: random.Random, steps: range, phases: tuple[str, ...]) -> list[Kill]:
    return [Kill(phase, step, rng.uniform(0, 0.04)) for step in steps for phase in phases]


@pytest.fixture(scope="module")
def server():
    s = KillServer()
    yield s
    s.close()


@pytest.fixture(scope="module")
def serve_url(tmp_path_factory):
    logs = tmp_path_factory.mktemp("serve-logs")
    model = EXAMPLE / "model" / "warm_start"
    with launch_verst_servers(
        model, extra_args=["--num-threads", "1"], ready_timeout_s=180, log_dir=logs
    ) as launched:
        yield launched.urls[0]


@pytest.fixture()
def eval_file(tmp_path: Path) -> Path:
    path = tmp_path / "eval.jsonl"
    path.write_text("\n".join((EXAMPLE / "data" / "eval.jsonl").read_text().splitlines()[:4]) + "\n")
    return path


FULLY_ASYNC = ["rollout.fully_async=true", "rollout.partial_rollout=true"]


def _fully_async(server, tmp_path, eval_file, kills: list[Kill]) -> None:
    straight = tmp_path / "straight"
    argv = _argv(straight, eval_file, FULLY_ASYNC)
    starts = [0]
    assert server.run(argv, straight)["code"] == 0
    _assert_conserved(straight, starts)
    resumed = tmp_path / "resumed"
    landed, starts = _chain(server, resumed, _argv(resumed, eval_file, FULLY_ASYNC), kills)
    assert landed >= len(kills) // 2, f"only {landed} of {len(kills)} kills landed"
    _assert_conserved(resumed, starts)


def _serve(server, tmp_path, eval_file, url: str, kills: list[Kill]) -> None:
    engine = [f'engine={{type="sglang", urls=["{url}"]}}']
    straight = tmp_path / "straight"
    assert server.run(_argv(straight, eval_file, engine), straight)["code"] == 0
    reference = _assert_conserved(straight, [0])
    resumed = tmp_path / "resumed"
    landed, starts = _chain(server, resumed, _argv(resumed, eval_file, engine), kills)
    assert landed >= len(kills) // 2, f"only {landed} of {len(kills)} kills landed"
    assert _assert_conserved(resumed, starts) == reference  # the same prompts at every step


@pytest.mark.timeout(900)
def test_fully_async_partial_rollout_sigkill_then_resume_loses_no_prompt(server, tmp_path, eval_file):
    kills = _kills(random.Random(0), range(1, STEPS - 1), ("rollout", "train", "checkpoint"))
    _fully_async(server, tmp_path, eval_file, kills)


@pytest.mark.timeout(900)
def test_verst_serve_sigkill_then_resume_trains_the_same_prompts(server, serve_url, tmp_path, eval_file):
    kills = _kills(random.Random(0), range(1, STEPS - 1), ("rollout", "sync", "checkpoint"))
    _serve(server, tmp_path, eval_file, serve_url, kills)


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("seed", [1, 2])
def test_fully_async_and_serve_at_random_moments(server, serve_url, tmp_path, eval_file, seed):
    rng = random.Random(seed)
    phases = ("rollout", "train", "sync", "eval", "checkpoint")
    kills = _kills(rng, range(STEPS), phases) + [Kill(after_s=rng.uniform(0.5, 4.0)) for _ in range(5)]
    _fully_async(server, tmp_path / "async", eval_file, kills)
    _serve(server, tmp_path / "serve", eval_file, serve_url, kills)
