"""One training step per algorithm, behind one small interface.

The trainer (:class:`grace_training.trainer.GRPOTrainer`) owns the run: data order, the policy and its
optimiser, checkpoints, resume, evaluation, logging, Hub pushes. What one step does with a batch is the
algorithm's: a :class:`TrainingStep` built once a run with the trainer, called once a step with the
step's triplets, returning the step's metrics (``loss`` and ``time/step_s`` at least) after one optimiser
step. Adding an algorithm is a module with its step class and a line in the trainer's registry
(:data:`grace_training.trainer.ALGORITHMS`).

- ``grpo``: :class:`grace_training.algorithms.grpo.step.GRPOStep`, GRACE's rollouts, rewards and Eq. 11 with the
  hybrid term (method.md §2);
- ``icr``: :class:`grace_training.algorithms.icr.step.ICRStep`, GIRCSE's Iterative Contrastive Refinement on soft
  tokens (gircse.md, Eqs. 7–8).

(``infonce``, the yardstick, trains through sentence-transformers' own trainer:
:func:`grace_training.algorithms.infonce.train_infonce`.)
"""

from __future__ import annotations


class TrainingStep:
    """One algorithm's step. Reads the run's state through :attr:`run` (the trainer): the config, the
    accelerator, the encoder and its policy (plain and wrapped for DDP/FSDP), the optimiser and schedule."""

    label = "training"  # the progress bar's name for the run

    def __init__(self, run) -> None:
        self.run = run

    def __call__(self, batch: list, step: int) -> dict[str, float]:
        raise NotImplementedError

    def after_resume(self) -> None:
        """Called once a checkpoint's weights are in (a rollout engine holding a copy of them syncs)."""

    # the run's state, read when used: the optimiser and the wrapped policy exist once accelerate prepared them
    @property
    def config(self):
        return self.run.config

    @property
    def accelerator(self):
        return self.run.accelerator

    @property
    def encoder(self):
        return self.run.encoder

    @property
    def policy(self):
        return self.run.policy

    @property
    def policy_wrapped(self):
        return self.run.policy_wrapped

    @property
    def optimizer(self):
        return self.run.optimizer

    @property
    def scheduler(self):
        return self.run.scheduler

    def update_metrics(self, step: int, lr: float, grad_norm, times: tuple[float, float, float, float], cpu_s: float) -> dict:
        """The metrics every embedding-loss step logs besides its losses: the gradient norm, the rate, the epoch, and
        the update's times (``times``: its start, the end of the forward, of the backward, of the optimiser step)."""
        start, forwarded, backwarded, done = times
        return {
            "grad_norm": float(grad_norm),
            "lr": lr,
            "epoch": (step + 1) / self.run.steps_per_epoch,
            "time/update_forward_s": forwarded - start,
            "time/update_backward_s": backwarded - forwarded,
            "time/update_optimizer_s": done - backwarded,
            "time/step_s": done - start,
            "time/step_cpu_s": cpu_s,
        }

    def optimizer_step(self) -> float:
        """Clip the gradients (``max_grad_norm``; 0: no clipping) and step the optimiser; the gradient norm."""
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else float("inf")
        grad_norm = self.accelerator.clip_grad_norm_(self.run.trainable_parameters(), max_norm)
        self.optimizer.step()
        return grad_norm
