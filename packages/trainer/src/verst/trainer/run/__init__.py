"""The loop around steps: `controller.run_training`, the rollout side (`rollout_side`), the run
directory (`run_dir`), recording, progress, curves, checkpoints, signals, export, metrics."""
