"""verst trainer: GRPO-family training."""
