"""GIRCSE's iterative contrastive refinement (``gircse.md`` §3)."""
