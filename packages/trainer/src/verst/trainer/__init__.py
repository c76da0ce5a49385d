"""verst trainer: GRPO-family training.

One folder per stage of a step:

- `train/` — the policy and one optimizer step: model loading, FSDP, LoRA, batch building,
  sequence layouts, log-probs, the logit head, `TrainSide`, and SFT.
- `sync/` — getting trained weights to the engines: `WeightSync`, its modes, the distributed
  group, LoRA sync, colocation of trainer and engine memory.
- `run/` — the loop around steps: the controller, the rollout side, the run directory,
  recording, progress, curves, checkpoints, signals, export, metrics.
- kept: `algorithms/` (pure torch), `opd/` (on-policy distillation), `placement/` (Ray),
  `dashboard/`; the root holds `cli.py` (the edge) and `config*.py` (the `[run]`/`[train]` schema).

May import: `train` imports neither `sync` nor `run`; `sync` imports `train`; `run` imports both.
"""
