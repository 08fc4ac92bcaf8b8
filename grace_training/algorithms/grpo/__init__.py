"""GRPO with contrastive rewards (``method.md`` §2): rollouts, rewards, the clipped update."""
