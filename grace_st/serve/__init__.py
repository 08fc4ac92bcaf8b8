"""``grace-st serve``: the OpenAI-compatible HTTP server and the scheduler that batches across requests."""
