"""GRC's training step (grc.md, Eq. 5): one masked forward over each text's response, latents and reconstruction
turn, three losses, one optimiser step (:func:`grace_training.algorithms.grc.loss.grc_batch_loss`).

The latents and the adapter A (:class:`grace_st.methods.grc.LatentTokens`) train beside the policy (its LoRA adapter or
its full weights): the trainer's optimiser holds them (:meth:`GRCStep.extra_parameters`), and a checkpoint saves them
with the model (``latent_tokens.safetensors``) and restores them on resume (:meth:`GRCStep.load_extra_state`). One
process: the latents sit outside the model that DDP wraps, so their gradients would not be averaged (refused at the
start).
"""

from __future__ import annotations

from pathlib import Path

import torch

from grace_st.methods.grc import LATENT_FILE, sliding_window
from grace_training.algorithms.grc.loss import grc_batch_loss
from grace_training.config.validation import ConfigError
from grace_training.data.examples import Triplet
from grace_training.run.checkpoint import load_state_file
from grace_training.steps import StepContext, TrainingStep


class GRCStep(TrainingStep):
    def __init__(self, context: StepContext) -> None:
        super().__init__(context)
        if context.accelerator.num_processes > 1:
            raise ValueError("algorithm grc trains in one process (its latent tokens are not wrapped by DDP)")

    @classmethod
    def prepare_encoder(cls, encoder, config) -> None:
        """The model's own masking checked, and the latent tokens: the start model's, or fresh ones."""
        try:  # Eq. 5's masked pass masks each layer as the model's own pass does, or the model is refused here
            sliding_window(encoder.model.config)
        except ValueError as error:
            raise ConfigError(f"algorithm: grc: {error}", key="algorithm") from None
        encoder.num_latent_tokens = config.num_latent_tokens
        encoder.prepare_method_state()  # the latent tokens: the start model's, or fresh ones

    @classmethod
    def needs_reference(cls, config) -> bool:
        return config.grc_response_targets == "start"  # L_Gen's targets are the start model's answers

    @classmethod
    def extra_parameters(cls, encoder) -> list[torch.nn.Parameter]:
        return list(encoder.latent_tokens.parameters()) if encoder.latent_tokens is not None else []

    @classmethod
    def load_extra_state(cls, checkpoint: str | Path, encoder) -> None:
        if encoder.latent_tokens is not None:
            load_state_file(checkpoint, LATENT_FILE, encoder.latent_tokens, "a GRC run")

    def loss(self, batch: list[Triplet], step: int, scores: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        """Eq. 5: α L_Gen + β L_Recons + γ L_Rep, and each term."""
        parts = grc_batch_loss(
            self.encoder, batch, self.config, scores, seed=self.config.seed + step, start_model=self.context.reference
        )
        return parts["loss"], {
            "loss/generation": parts["generation"].item(),
            "loss/reconstruction": parts["reconstruction"].item(),
            "loss/representation": parts["representation"].item(),
            "batch/tokens": parts["tokens"],
        }
