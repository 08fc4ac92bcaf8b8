"""The record an algorithm registers (:class:`Algorithm`): everything the loop, the config, the run directory and
the CLI know of it. It imports nothing heavy: the config reads it, and its step class is imported when a run starts."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

CONFIG_FILE = "config.yaml"
CHANGES_FILE = "config_changes.jsonl"
# What a run of the loop (grace_training.trainer) writes in its directory besides checkpoints, whatever its step.
LOOP_FILES = (CONFIG_FILE, CHANGES_FILE, "metrics.jsonl", "tensorboard", "hub_queue.json", "initial-model")


@dataclass(frozen=True)
class Algorithm:
    """One training algorithm.

    Attributes:
        name: the config's ``algorithm`` value.
        method: how the trained model thinks (``grace_st.settings.METHODS``), saved as the encoder's ``method``.
        summary: one line for ``--help`` and the docs' list of algorithms.
        step: its :class:`~grace_training.steps.TrainingStep` subclass, or ``"module:Class"`` naming it (imported
            when a run starts, so the config can read the record without importing torch code); None: it trains
            outside the loop (the InfoNCE yardstick).
        label: the progress bar's name for a run.
        config_keys: the config keys only it reads.
        refused_keys: other algorithms' keys a run of this one refuses when set away from their defaults (they change
            what those algorithms train, and this one would ignore them).
        embedding_loss: its loss is on embeddings directly (no rollouts, rewards or policy term): it trains scored
            pairs without the hybrid term, with the HF model in one pass a step.
        prompt_formats: the encoder prompt formats it trains.
        run_files: the names a run writes in its directory besides checkpoints (replaced when a run shares a folder,
            deleted with the run it belongs to).
    """

    name: str
    method: str
    summary: str
    step: type | str | None
    label: str = ""
    config_keys: tuple[str, ...] = ()
    refused_keys: tuple[str, ...] = ()
    embedding_loss: bool = False
    prompt_formats: tuple[str, ...] = ("chat",)
    run_files: tuple[str, ...] = LOOP_FILES

    def step_class(self) -> type | None:
        """The step class (imported on first use when ``step`` names it)."""
        if not isinstance(self.step, str):
            return self.step
        module, _, name = self.step.partition(":")
        return getattr(importlib.import_module(module), name)
