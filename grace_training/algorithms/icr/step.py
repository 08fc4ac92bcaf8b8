"""GIRCSE's training step (gircse.md): Iterative Contrastive Refinement on soft tokens, one optimiser step.

The batch's soft-token embeddings z_1..z_K come with gradient from the engine that ``encode`` uses
(:meth:`grace_st.methods.SoftTokenEngine.step_embeddings`); the loss is Eq. 7's stepwise InfoNCE (CoSENT
for a batch of scored pairs) + λ · Eq. 8 (:func:`grace_training.algorithms.icr.loss.icr_batch_loss`). No rollouts, no
rewards, no policy term.
"""

from __future__ import annotations

import contextlib
import time

from grace_training.algorithms.icr.loss import icr_batch_loss
from grace_training.data.examples import Triplet
from grace_training.run.processes import sum_over_processes
from grace_training.steps import TrainingStep


class ICRStep(TrainingStep):
    label = "GIRCSE (ICR)"

    def __call__(self, batch: list[Triplet], step: int) -> dict[str, float]:
        cfg, accelerator = self.config, self.accelerator
        start, cpu_start = time.perf_counter(), time.process_time()
        lr = self.scheduler.get_last_lr()[0]
        self.policy_wrapped.train()
        self.optimizer.zero_grad(set_to_none=True)
        # The soft steps call the decoder and the LM head one at a time, not the wrapped model once, so
        # DDP's own all-reduce is kept out and the gradients are averaged over processes here.
        separate = (
            accelerator.no_sync(self.policy_wrapped) if accelerator.num_processes > 1 else contextlib.nullcontext()
        )
        with separate:
            with accelerator.autocast():
                parts = icr_batch_loss(
                    self.encoder, batch, cfg, self.run.graded_scores(step), accelerator.device, accelerator
                )
            forwarded = time.perf_counter()
            accelerator.backward(parts["loss"])
        if accelerator.num_processes > 1:
            for parameter in self.run.trainable_parameters():
                if parameter.grad is not None:
                    parameter.grad = accelerator.reduce(parameter.grad, reduction="mean")
        backwarded = time.perf_counter()
        grad_norm = self.optimizer_step()
        self.scheduler.step()
        self.policy_wrapped.eval()
        done = time.perf_counter()
        self.run.last_example = None  # a soft token has no text; explain() shows its trace
        return {
            "loss": parts["loss"].item(),
            "loss/contrastive": parts["contrastive"].item(),
            "loss/refinement": parts["refinement"].item(),
            **{f"loss/step_{k + 1}": float(v) for k, v in enumerate(parts["step_losses"].tolist())},
            # the step's CPU cost over every process, as a GRPO step's (the losses are global already)
            **self.update_metrics(
                step, lr, grad_norm, (start, forwarded, backwarded, done),
                sum_over_processes(accelerator, time.process_time() - cpu_start)[0],
            ),
        }
