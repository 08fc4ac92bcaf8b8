"""GIRCSE's training step (gircse.md): Iterative Contrastive Refinement on soft tokens, one optimiser step.

The batch's soft-token embeddings z_1..z_K come with gradient from the engine that ``encode`` uses
(:meth:`grace_st.methods.SoftTokenEngine.step_embeddings`); the loss is Eq. 7's stepwise InfoNCE (CoSENT
for a batch of scored pairs) + λ · Eq. 8 (:func:`grace_training.algorithms.icr.loss.icr_batch_loss`). No rollouts, no
rewards, no policy term; a soft token has no text, so the step shows no example (explain() shows its trace).
"""

from __future__ import annotations

import torch

from grace_training.algorithms.icr.loss import icr_batch_loss
from grace_training.data.examples import Triplet
from grace_training.steps import TrainingStep


class ICRStep(TrainingStep):
    def loss(self, batch: list[Triplet], step: int, scores: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        """Eq. 7 at every soft step + λ · Eq. 8, and each step's loss."""
        accelerator = self.accelerator
        parts = icr_batch_loss(self.encoder, batch, self.config, scores, accelerator.device, accelerator)
        return parts["loss"], {
            "loss/contrastive": parts["contrastive"].item(),
            "loss/refinement": parts["refinement"].item(),
            **{f"loss/step_{k + 1}": float(v) for k, v in enumerate(parts["step_losses"].tolist())},
        }
