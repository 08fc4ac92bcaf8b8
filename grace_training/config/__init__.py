"""A training run's configuration: its keys and rules (``train_config``), value checks and output folders."""

from grace_training.config.train_config import GRPOConfig, TrainConfig
from grace_training.config.validation import ConfigError

__all__ = ["ConfigError", "GRPOConfig", "TrainConfig"]
