"""grace_training: the GRACE GRPO trainer (installed from training/ as ``grace_training``)."""
