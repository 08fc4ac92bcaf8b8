"""GRC's training step (grc.md, Eq. 5): one masked forward over each text's response, latents and reconstruction
turn, three losses, one optimiser step (:func:`grace_training.algorithms.grc.loss.grc_batch_loss`).

The latents and the adapter A (:class:`grace_st.methods.grc.LatentTokens`) train beside the policy (its LoRA adapter or
its full weights): the trainer's optimiser holds them, and a checkpoint saves them with the model
(``latent_tokens.safetensors``) and restores them on resume. One process: the latents sit outside the model
that DDP wraps, so their gradients would not be averaged (refused at the start).
"""

from __future__ import annotations

import time

from grace_training.algorithms.grc.loss import grc_batch_loss
from grace_training.data.examples import Triplet
from grace_training.steps import TrainingStep


class GRCStep(TrainingStep):
    label = "GRC"

    def __init__(self, run) -> None:
        super().__init__(run)
        if run.accelerator.num_processes > 1:
            raise ValueError("algorithm grc trains in one process (its latent tokens are not wrapped by DDP)")

    def __call__(self, batch: list[Triplet], step: int) -> dict[str, float]:
        cfg, accelerator = self.config, self.accelerator
        start, cpu_start = time.perf_counter(), time.process_time()
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.zero_grad(set_to_none=True)
        with accelerator.autocast():
            self.policy_wrapped.train()
            parts = grc_batch_loss(
                self.encoder, batch, cfg, self.run.graded_scores(step), seed=cfg.seed + step,
                start_model=self.run.reference,
            )
        forwarded = time.perf_counter()
        accelerator.backward(parts["loss"])
        backwarded = time.perf_counter()
        grad_norm = self.optimizer_step()
        self.scheduler.step()
        self.policy_wrapped.eval()
        done = time.perf_counter()
        self.run.last_example = None
        return {
            "loss": parts["loss"].item(),
            "loss/generation": parts["generation"].item(),
            "loss/reconstruction": parts["reconstruction"].item(),
            "loss/representation": parts["representation"].item(),
            "batch/tokens": parts["tokens"],
            **self.update_metrics(
                step, lr, grad_norm, (start, forwarded, backwarded, done), time.process_time() - cpu_start
            ),
        }
