"""Training data: sources read into triplets (``examples``), hard negatives mined, and the batch order."""

from grace_training.data.examples import Triplet, load_data

__all__ = ["Triplet", "load_data"]
