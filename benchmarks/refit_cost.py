"""Refit cost at scale: seconds and bytes per weight sync, today's path against the planned one
(`verst.trainer.sync.plan`), per sync mode, in one run.

The model is `vs_trl_scale.py`'s (`--size small`: the 31.5M SmolLM2-architecture Llama with
tied embeddings and SmolLM2's vocabulary of 49,152; `--size 135m`: SmolLM2-135M's architecture),
random weights, float32 masters on the train side (`TrainSide`, CPU). The engines hold bfloat16
weights. Cases:

- `inproc`: `tensors` to an embedded engine in this process;
- `http`: `tensors` over HTTP to a `verst serve` process (SGLang's `/update_weights_from_tensor`
  body, CPU tensors pickled by value);
- `disk`: `disk` to a `verst serve` process (a checkpoint under the staging folder, loaded by it);
- `http_frozen`: `http` with the embeddings frozen (`requires_grad=False`, the stand-in for a
  frozen tower or frozen embeddings: the tied embedding is 60% of the 31.5M model).

Each case has two engines of the same kind: A gets today's path (`wire_dtype = "trained"`,
`every_tensor = true`: every state-dict tensor as trained, the tied `lm_head.weight` included),
B the default (the engine's dtype on the wire when it crosses a process, each tensor once,
frozen ones only when the engine may have lost them). After one warm-up push each (B's first
push is a full one), `--pairs` pairs alternate A and B (ABBA order); the per-pair time ratios
A/B and their median are reported with the bytes each push shipped (`sync/bytes`).

    uv run --group bench --group realmodel python benchmarks/refit_cost.py                 # ~2 min
    uv run --group bench --group realmodel python benchmarks/refit_cost.py --size 135m

Last line: `inproc_speedup=<r> http_speedup=<r> disk_speedup=<r> http_frozen_speedup=<r>
inproc_bytes_ratio=<r> http_bytes_ratio=<r> disk_bytes_ratio=<r> http_frozen_bytes_ratio=<r>
new_http_s=<s> new_http_mib=<m>` (ratios: A over B).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl_scale import CACHE, make_checkpoint, smollm2_tokenizer

OLD = {"wire_dtype": "trained", "every_tensor": True}
"""Today's path: every state-dict tensor, as trained."""
CASES = {
    "inproc": ("tensors", "embedded", False),
    "http": ("tensors", "served", False),
    "disk": ("disk", "served", False),
    "http_frozen": ("tensors", "served", True),
}
"""case: (mode, engine kind, embeddings frozen)."""


def train_side(model: Path, work: Path) -> Any:
    from verst.trainer.config import run_config_from_dict
    from verst.trainer.train.side import TrainSide

    data = work / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    cfg = run_config_from_dict(
        {
            "train": {"model_path": str(model)},
            "rollout": {"data": {"path": str(data)}},
            "run": {"num_steps": 1},
        }
    )
    return TrainSide(
        cfg.train, cfg.algorithm, model_path=str(model), total_steps=1, max_response_len=8,
        temperature=1.0, env={},
    ), cfg  # fmt: skip


def rollout_sides(kind: str, cfg: Any, model: Path, urls: list[str]) -> list[Any]:
    """Two rollout sides of one kind (A's and B's engines)."""
    from verst.rollout.engines.embedded.engine import EmbeddedEngine
    from verst.trainer.config import run_config_from_dict
    from verst.trainer.run.rollout_side import RolloutSide

    if kind == "embedded":
        return [
            RolloutSide(
                cfg,
                model_path=str(model),
                env={},
                engine=EmbeddedEngine.from_pretrained(model, dtype="bfloat16", device="cpu"),
            )
            for _ in range(2)
        ]
    sides = []
    for url in urls:
        d = json.loads(cfg.model_dump_json())
        d["engine"] = {"type": "sglang", "urls": [url]}
        sides.append(RolloutSide(run_config_from_dict(d), model_path=str(model), env={}))
    return sides


def run_case(name: str, train: Any, sides: list[Any], work: Path, pairs: int) -> dict[str, Any]:
    from verst.trainer.sync.weight_sync import WeightSync
    from verst.trainer.train.fsdp import DistInfo

    mode, _, frozen = CASES[name]
    embed = train.bundle.hf_model.get_input_embeddings()
    embed.requires_grad_(not frozen)
    versions = [s.weight_version() for s in sides]
    syncs = [
        WeightSync(
            train,
            side,
            mode={"type": mode, **opts},
            staging_dir=work / f"{name}-{i}",
            dist_info=DistInfo(),
            weight_version=v,
        )
        for i, (side, opts, v) in enumerate(zip(sides, [OLD, {}], versions, strict=True))
    ]
    times: list[list[float]] = [[], []]
    for s in syncs:
        s.push()  # warm-up (B's first push sends everything)
    for p in range(pairs):
        for i in (0, 1) if p % 2 == 0 else (1, 0):
            t0 = time.perf_counter()
            syncs[i].push()
            times[i].append(time.perf_counter() - t0)
    embed.requires_grad_(True)
    ratios = [a / b for a, b in zip(times[0], times[1], strict=True)]
    return {
        "case": name,
        "old_s": statistics.median(times[0]),
        "new_s": statistics.median(times[1]),
        "ratios": [round(r, 3) for r in ratios],
        "speedup": statistics.median(ratios),
        "old_bytes": syncs[0].last_bytes,
        "new_bytes": syncs[1].last_bytes,
        "new_full": syncs[1].last_full,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=["small", "135m"], default="small")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cases", default=",".join(CASES))
    a = ap.parse_args()

    import torch

    from verst.rollout.engines.sglang.launcher import launch_verst_servers

    torch.set_num_threads(a.threads)
    model = CACHE / f"refit-{a.size}"
    if not (model / "config.json").exists():
        make_checkpoint(a.size, smollm2_tokenizer(), model)
    cases = a.cases.split(",")
    with tempfile.TemporaryDirectory(prefix="verst-refit-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        train, cfg = train_side(model, work)
        n = sum(p.numel() for p in train.bundle.hf_model.parameters())
        urls: list[str] = []
        if any(CASES[c][1] == "served" for c in cases):
            args = ["--dtype", "bfloat16", "--num-threads", str(a.threads)]
            urls = stack.enter_context(
                launch_verst_servers(model, num_servers=2, extra_args=args, ready_timeout_s=600)
            ).urls
        load = os.getloadavg()[0]
        print(f"size={a.size} params={n / 1e6:.1f}M engine=bfloat16 trainer=float32 threads={a.threads} "
              f"pairs={a.pairs} load1={load:.2f} (under load when > 1)", flush=True)  # fmt: skip
        results = {}
        sides_by_kind: dict[str, list[Any]] = {}
        for name in cases:
            kind = CASES[name][1]
            if kind not in sides_by_kind:
                sides_by_kind[kind] = rollout_sides(kind, cfg, model, urls)
            r = run_case(name, train, sides_by_kind[kind], work, a.pairs)
            results[name] = r
            print(f"{name:12s} old {r['old_s']:.3f} s {r['old_bytes'] / 2**20:7.1f} MiB | new {r['new_s']:.3f} s "
                  f"{r['new_bytes'] / 2**20:7.1f} MiB | A/B per pair {r['ratios']} median {r['speedup']:.2f}",
                  flush=True)  # fmt: skip
        for sides in sides_by_kind.values():
            for side in sides:
                side.close()
        train.close()
    keys = [f"{c}_speedup={results[c]['speedup']:.3f}" for c in results]
    keys += [f"{c}_bytes_ratio={results[c]['old_bytes'] / results[c]['new_bytes']:.3f}" for c in results]
    if "http" in results:
        keys += [
            f"new_http_s={results['http']['new_s']:.3f}",
            f"new_http_mib={results['http']['new_bytes'] / 2**20:.1f}",
        ]
    print(" ".join(keys))


if __name__ == "__main__":
    main()
