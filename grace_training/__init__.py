"""grace_training: the GRACE GRPO trainer."""
