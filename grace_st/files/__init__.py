"""Model files: loading a model folder or Hub id, adapters, the Hub, and the model's identity for mteb."""
