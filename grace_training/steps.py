"""One training step per algorithm, behind one small interface.

The trainer (:class:`grace_training.trainer.Trainer`) owns the run: data order, the policy and its optimiser,
checkpoints, resume, evaluation, logging, Hub pushes. What one step does with a batch is the algorithm's: a
:class:`TrainingStep` built once a run with the run's :class:`StepContext`, called once a step with the step's
triplets, returning a :class:`StepResult` (the step's metrics, ``loss`` and ``time/step_s`` at least, after one
optimiser step). Four algorithms train, each registered by a record
(:class:`~grace_training.algorithms.base.Algorithm`) in :mod:`grace_training.algorithms.registry`:

- ``grpo``: :class:`grace_training.algorithms.grpo.step.GRPOStep`, GRACE's rollouts, rewards and Eq. 11 with the
  hybrid term (method.md §2); it overrides :meth:`TrainingStep.__call__` (PPO epochs, chunks);
- ``icr``: :class:`grace_training.algorithms.icr.step.ICRStep`, GIRCSE's Iterative Contrastive Refinement on soft
  tokens (gircse.md, Eqs. 7–8);
- ``grc``: :class:`grace_training.algorithms.grc.step.GRCStep`, GRC's Eq. 5 on meta latent tokens (grc.md);
- ``infonce``: the yardstick. It trains through sentence-transformers' own trainer
  (:func:`grace_training.algorithms.infonce.train.train_infonce`), a second loop kept on purpose: a reference
  measured with a standard trainer, not a step of this one.

A step whose loss is on embeddings implements :meth:`TrainingStep.loss` alone; the shared sequence around it
(timers, ``zero_grad``, autocast, backward, clipping, the optimiser and schedule steps, the metrics) is
:meth:`TrainingStep.__call__`'s. The class-level hooks (:meth:`~TrainingStep.prepare_encoder`,
:meth:`~TrainingStep.needs_reference`, :meth:`~TrainingStep.extra_parameters`,
:meth:`~TrainingStep.load_extra_state`) are what the loop asks of an algorithm before its step exists.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from grace_training.run.processes import sum_over_processes


@dataclass(frozen=True)
class StepContext:
    """The run's state a step reads, handed over once: the optimiser and the wrapped policy are accelerate's."""

    config: Any
    accelerator: Any
    st_model: Any  # the SentenceTransformer
    encoder: Any  # its GenerativeEncoder
    policy: torch.nn.Module  # the encoder's LM (with its LoRA adapter)
    policy_wrapped: torch.nn.Module  # the policy as accelerate prepared it (DDP, FSDP)
    optimizer: Any
    scheduler: Any
    reference: torch.nn.Module | None  # the frozen start model (full fine-tuning with a KL term or start targets)
    steps_per_epoch: int
    local_batch_size: int
    parameters: Sequence[torch.nn.Parameter]  # what the optimiser steps, as the wrapped policy holds it
    graded_scores: Callable[[int], torch.Tensor | None]  # the step's gold scores when it is a batch of scored pairs


@dataclass
class StepResult:
    """What a step returns: its metrics, and a text with its rationale for the model card (None: nothing to show)."""

    metrics: dict[str, float]
    example: dict[str, str] | None = None


class TrainingStep:
    """One algorithm's step over the run's :class:`StepContext`."""

    def __init__(self, context: StepContext) -> None:
        self.context = context
        self.config = context.config
        self.accelerator = context.accelerator
        self.encoder = context.encoder
        self.policy = context.policy
        self.policy_wrapped = context.policy_wrapped
        self.optimizer = context.optimizer
        self.scheduler = context.scheduler

    # -- what the loop asks before the step exists -------------------------------------------------

    @classmethod
    def prepare_encoder(cls, encoder, config) -> None:
        """Set the encoder up for this algorithm once its method is set (before any adapter is added)."""

    @classmethod
    def needs_reference(cls, config) -> bool:
        """Whether the step reads the frozen start model (kept as a copy under full fine-tuning)."""
        return False

    @classmethod
    def extra_parameters(cls, encoder) -> list[torch.nn.Parameter]:
        """Parameters trained beside the policy's (the optimiser holds them, clipping reads them)."""
        return []

    @classmethod
    def load_extra_state(cls, checkpoint: str | Path, encoder) -> None:
        """Restore what :meth:`extra_parameters` trains from a checkpoint, in place."""

    def after_resume(self) -> None:
        """Called once a checkpoint's weights are in (a rollout engine holding a copy of them syncs)."""

    # -- one step ------------------------------------------------------------------------------

    def loss(self, batch: list, step: int, scores: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
        """The step's loss with gradient, and its parts as named metrics (``scores``: the graded scores of a batch
        of scored pairs, else None)."""
        raise NotImplementedError

    def __call__(self, batch: list, step: int) -> StepResult:
        """:meth:`loss`, backpropagated, then one optimiser step and the schedule's. The loss may call the policy's
        modules one at a time rather than the wrapped model once, so DDP's own all-reduce is kept out and the
        gradients are averaged over processes here."""
        accelerator = self.accelerator
        start, cpu_start = time.perf_counter(), time.process_time()
        lr = self.scheduler.get_last_lr()[0]
        scores = self.context.graded_scores(step)
        self.policy_wrapped.train()
        self.optimizer.zero_grad(set_to_none=True)
        several = accelerator.num_processes > 1
        separate = accelerator.no_sync(self.policy_wrapped) if several else contextlib.nullcontext()
        with separate:
            with accelerator.autocast():
                loss, parts = self.loss(batch, step, scores)
            forwarded = time.perf_counter()
            accelerator.backward(loss)
        if several:
            for parameter in self.context.parameters:
                if parameter.grad is not None:
                    parameter.grad = accelerator.reduce(parameter.grad, reduction="mean")
        backwarded = time.perf_counter()
        grad_norm = self.optimizer_step()
        self.scheduler.step()
        self.policy_wrapped.eval()
        done = time.perf_counter()
        # the step's CPU cost over every process, as a GRPO step's (the losses are global already)
        cpu_s = sum_over_processes(accelerator, time.process_time() - cpu_start)[0]
        times = (start, forwarded, backwarded, done)
        return StepResult({"loss": loss.item(), **parts, **self.update_metrics(step, lr, grad_norm, times, cpu_s)})

    def update_metrics(self, step: int, lr: float, grad_norm, times: tuple[float, float, float, float], cpu_s: float) -> dict:
        """The metrics every step logs besides its losses: the gradient norm, the rate, the epoch, and the update's
        times (``times``: its start, the end of the forward, of the backward, of the optimiser step)."""
        start, forwarded, backwarded, done = times
        return {
            "grad_norm": float(grad_norm),
            "lr": lr,
            "epoch": (step + 1) / self.context.steps_per_epoch,
            "time/update_forward_s": forwarded - start,
            "time/update_backward_s": backwarded - forwarded,
            "time/update_optimizer_s": done - backwarded,
            "time/step_s": done - start,
            "time/step_cpu_s": cpu_s,
        }

    def optimizer_step(self) -> float:
        """Clip the gradients (``max_grad_norm``; 0: no clipping) and step the optimiser; the gradient norm."""
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else float("inf")
        grad_norm = self.accelerator.clip_grad_norm_(list(self.context.parameters), max_norm)
        self.optimizer.step()
        return grad_norm
