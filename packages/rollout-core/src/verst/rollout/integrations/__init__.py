"""Adapters to environment ecosystems (reasoning-gym, verifiers, OpenEnv, NeMo Gym); each imports its package only when selected. See docs/environments.md."""
