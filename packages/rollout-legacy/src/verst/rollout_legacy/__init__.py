"""verst legacy (v1) function-based rollout."""
