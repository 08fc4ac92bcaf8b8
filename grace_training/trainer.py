"""The GRACE GRPO loop (method.md §2): rollout → embed → reward → advantage → update.

Read :meth:`GRPOTrainer.train` top to bottom; each stage is a method a test can call alone:

- :meth:`~GRPOTrainer.batch_for_step`: the step's B triplets (:mod:`.sampling`: a function of the
  step number, so a resumed run sees the batches a straight run would);
- :meth:`~GRPOTrainer.rollout`: Eq. 4 with embeddings by Eq. 3 (no gradient);
- :meth:`~GRPOTrainer.compute_rewards`: Eqs. 5–9, 13, 28;
- :func:`grace_training.grpo.group_advantages`: Eq. 10;
- :meth:`~GRPOTrainer.update`: Eq. 11, one optimiser step (or ``ppo_epochs`` clipped ones), plus
  β · :func:`grace_training.grpo.pooled_contrastive_loss` on the same pass's pooled states when
  ``contrastive_beta`` > 0 (the hybrid objective; β = 0 is the paper's GRACE);
- :meth:`~GRPOTrainer.save_checkpoint` / :meth:`~GRPOTrainer.resume`; the run owns its
  ``output_dir`` (a marker, only its own checkpoints rotated) and a resume compares the checkpoint's
  config with the one given (:mod:`.run_dir`).

Why one file of ~750 lines: the class owns the run's state (accelerator, policy, optimizer, data
order, checkpoints), and its stages are methods so that a test can call each one alone. What needs
none of that state lives beside it: Eq. 11 and the log-probs in :mod:`.grpo`, the rewards in
:mod:`.rewards`, the hybrid term in :mod:`.hybrid`, rollouts in :mod:`.rollout`, gathering over
processes in :mod:`.processes`, the step's metrics in :mod:`.metrics`, the checkpoint format in
:mod:`.checkpoint` (with the choice of which checkpoint a resume takes), the run's directory and
what a resume may change in :mod:`.run_dir`.

Processes: ``accelerate`` runs it as one process, several CPU processes over gloo (DDP, tested
equal to one process), or several GPUs (DDP or FSDP2); see docs/training.md. The global batch is
split evenly across processes; the in-batch terms (Eq. 7, the hybrid InfoNCE) see every process's
rollouts through a gather, and Eq. 11's token count is the global batch's.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import time
from pathlib import Path
from typing import Any

import torch

from grace_st.transformers_compat import enable_activation_checkpointing

from .checkpoint import (
    RunFamily,
    check_checkpoint,
    load_checkpoint,
    load_newest_loadable,
    remove_incomplete,
    rotate_checkpoints,
    save_model_dir,
    write_checkpoint,
)
from .config import GRPOConfig, check_batches, check_environment, check_launch
from .data import Triplet, cap_per_source, load_data, source_weights
from .evaluation import evaluate
from .gircse import icr_batch_loss
from .grpo import (
    build_policy_batch,
    completion_log_probs,
    group_advantages,
    grpo_loss,
    policy_pass,
    text_kl,
    text_log_probs,
)
from .hybrid import graded_pairs_loss, hybrid_candidates, hybrid_contrastive_loss, pooled_with_grad
from .metrics import MetricsLogger, step_metrics
from .policy import add_lora_adapter, card_base_model, load_grace_model
from .processes import check_sharding, gather, processes_without_a_gpu, reduce_metrics, sum_over_processes
from .rewards import compute_rewards
from .rollout import TripletRollouts, asymmetric_rollouts, hf_generate
from .rollout_batch import RolloutBatch
from .run_dir import (
    CONFIG_FILE,
    check_config_changes,
    claim_output_dir,
    config_changes,
    inspect_output_dir,
    read_family,
    record_config_changes,
    saved_config,
)
from .sampling import BatchSchedule
from .vllm_backend import build_rollout_engine

logger = logging.getLogger(__name__)

# Settings the optimizer and the schedule hold in their state, restored from a checkpoint over the config's.
OPTIMIZER_KEYS = frozenset(
    ("learning_rate", "lr_scheduler", "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
     "max_steps", "epochs")
)


class GRPOTrainer:
    """GRPO with contrastive rewards over a GRACE SentenceTransformer's causal LM.

    Args:
        config: the run's settings (paper defaults).
        model: a GRACE SentenceTransformer (``grace_st.from_causal_lm`` or loaded); default:
            ``config.model_name_or_path``, or the embedded default model.
        train_data, eval_data: lists of :class:`~grace_training.data.Triplet`; default: loaded
            from ``config.train_data`` / ``config.eval_data``.
        hub_api: a stand-in for ``huggingface_hub.HfApi`` (tests); default: the real one.
        overwrite_output_dir: start in a directory that holds an earlier run (deleting that run's
            files) or other files (kept); see :mod:`grace_training.run_dir`.
        allow_config_change: let a resumed run change keys that change what is trained; they are
            applied from the next step and recorded in ``config_changes.jsonl``.
    """

    def __init__(
        self,
        config: GRPOConfig,
        *,
        model=None,
        train_data: list[Triplet] | None = None,
        eval_data: list[Triplet] | None = None,
        hub_api=None,
        accelerator=None,
        overwrite_output_dir: bool = False,
        allow_config_change: bool = False,
    ) -> None:
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        config.validate()
        check_environment(config)
        check_launch()
        self.config = config
        self.accelerator = accelerator or Accelerator(
            cpu=processes_without_a_gpu(), mixed_precision="bf16" if config.bf16 else "no"
        )
        check_sharding(self.accelerator, config)

        # -- data (before the model: a run the data cannot feed is refused without loading it) --
        self.train_data, self.eval_data = self._data(train_data, eval_data)
        world = self.accelerator.num_processes
        check_batches(config, len(self.train_data), world)
        self.local_batch_size = config.batch_size // world
        self.steps_per_epoch = len(self.train_data) // config.batch_size
        self.total_steps = config.max_steps if config.max_steps > 0 else config.epochs * self.steps_per_epoch
        weights = source_weights(config.train_data, self.train_data, config.data_dir) if config.train_data else None
        self.schedule = BatchSchedule(
            [t.source for t in self.train_data], config.batch_size, config.seed, config.batch_sampling, weights
        )

        # -- model, then optimisation -------------------------------------------------------
        set_seed(config.seed)
        self._load_policy(model)
        self._build_optimisation()

        # -- rollout backend ----------------------------------------------------------------
        self.engine = None
        self.generate = functools.partial(
            hf_generate, self.encoder, batch_size=config.rollout_batch_size, bucket_ratio=config.rollout_bucket_ratio
        )
        if config.rollout_backend == "vllm":
            self.engine = build_rollout_engine(self.encoder, self.st_model, config, self.accelerator)
            self.generate = self.engine.generate

        self.hub_api = hub_api
        self.overwrite_output_dir = overwrite_output_dir
        self.allow_config_change = allow_config_change
        self.run_family: RunFamily | None = None  # set when train() claims output_dir
        self.pusher = None
        self.metrics: MetricsLogger | None = None
        self.step = 0
        self.last_metrics: dict[str, Any] = {}
        self.last_scores: dict[str, float] = {}
        self.last_example: dict[str, str] | None = None
        self.base_model = card_base_model(config)

    def _load_policy(self, model) -> None:
        """The GRACE model (given, or loaded per the config), set to the budgets it trains with, and the
        policy: its LM, with a LoRA adapter unless ``finetune="full"``."""
        config = self.config
        self.st_model = model if model is not None else load_grace_model(config, str(self.accelerator.device))
        self.encoder = self.st_model[0]
        # The saved model encodes with the prompt and rationale budget it was trained with.
        self.encoder.max_input_tokens = config.max_input_tokens
        self.encoder.max_rationale_tokens = config.max_rationale_tokens
        self.encoder.method = "gircse" if config.method == "gircse" else "grace"  # what the saved model encodes with
        if self.encoder.repetition_penalty != 1.0:
            # Rollouts are draws from the policy itself: GRPO's ratios and KL are taken against its own
            # distribution, which a decoding-time penalty would bend. Trained without, saved without.
            logger.warning(
                "the start model's repetition_penalty %s is turned off: training rolls out the policy's own "
                "distribution, and the trained model is saved with repetition_penalty=1 (set it again to decode with it)",
                self.encoder.repetition_penalty,
            )
            self.encoder.repetition_penalty = 1.0
        if config.finetune == "lora":
            self.encoder.model = add_lora_adapter(self.encoder.model, config)
        self.policy = self.encoder.model
        if config.gradient_checkpointing:
            enable_activation_checkpointing(self.policy)

    def _build_optimisation(self) -> None:
        """The KL reference (full fine-tuning only), the optimizer and the schedule; the policy prepared
        by accelerate."""
        config = self.config
        # KL reference: with LoRA the base is the adapter disabled (no second copy in memory).
        self.reference = None
        if (config.kl_coef > 0 or config.text_kl_coef > 0) and config.finetune == "full":
            self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        optimizer = build_optimizer(self.policy, config)
        # The scheduler is stepped once per training step here, not through accelerate (which
        # would step it once per process).
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(config, self.total_steps))
        self.policy_wrapped, self.optimizer = self.accelerator.prepare(self.policy, optimizer)

    def _data(self, train_data, eval_data) -> tuple[list[Triplet], list[Triplet]]:
        """The training triplets, and the evaluation ones capped per source (``eval_max_examples``)."""
        config = self.config
        if train_data is None:
            train_data, _ = load_data(config.train_data, objective=config.objective, **config.data_settings())
        if eval_data is None and config.eval_data:
            eval_data, _ = load_data(config.eval_data, **config.data_settings())
        train_data = list(train_data)
        graded_ready = config.batch_sampling == "by_source" and (config.contrastive_beta > 0 or config.method == "gircse")
        if not graded_ready and any(row.score is not None for row in train_data):
            # a scored pair trained as a positive would pull a pair scored 0 together
            raise ValueError(
                "train_data: scored pairs (graded) train β · CoSENT on batches of their own: "
                "they need batch_sampling: by_source and contrastive_beta > 0 (or method: gircse)"
            )
        return train_data, cap_per_source(eval_data or [], config.eval_max_examples, config.eval_seed)

    # ------------------------------------------------------------------------------------------
    # the loop
    # ------------------------------------------------------------------------------------------

    def train(
        self, resume: bool | str = False, max_minutes: float | None = None, stop_at_step: int | None = None
    ) -> dict[str, Any]:
        """Run to ``total_steps``; with ``resume``, continue the latest (or given) checkpoint's trajectory.

        ``max_minutes``: one chunk of a long run. The loop stops at the first step that ends after
        that many minutes and saves a checkpoint there (the final evaluation waits for the run's
        last chunk); a later call with ``resume`` goes on exactly as an uninterrupted run would.
        ``stop_at_step``: a chunk that ends at that step, with a checkpoint, however long it takes.
        """
        cfg, main = self.config, self.accelerator.is_main_process
        deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
        self.run_family = self._claim_output_dir(bool(resume))
        if main:
            for path in remove_incomplete(cfg.output_dir, self.run_family):
                logger.warning("removed an incomplete checkpoint left by a crash: %s", path)
        self.accelerator.wait_for_everyone()  # every process lists checkpoints after the cleanup
        if resume:
            self.resume(None if resume is True else resume)
        if main:  # after the resume's config check: the record of the run is the config it goes on with
            cfg.to_yaml(Path(cfg.output_dir) / CONFIG_FILE)
        if resume and self.step >= self.total_steps:
            logger.info("the checkpoint at step %d already completes the run", self.step)
            return {"step": self.step, "metrics": self.last_metrics, "scores": self.last_scores}
        stop = self.total_steps if stop_at_step is None else min(stop_at_step, self.total_steps)
        if resume and self.step >= stop:
            logger.info("the checkpoint at step %d is already at --stop-at-step %d", self.step, stop_at_step)
            return {"step": self.step, "metrics": self.last_metrics, "scores": self.last_scores}
        self.metrics = MetricsLogger(
            cfg.output_dir, cfg.report_to, enabled=main, resume_step=self.step if resume else None
        )
        if cfg.push_to_hub and main:
            self.pusher = self._hub_pusher()
        if self.step == 0 and self.eval_data:
            self.last_scores = self.evaluate()
            self.metrics.log(0, self.last_scores)
        progress = _progress_bar(cfg.method, self.total_steps, self.step, disable=not main)
        saved_at = None
        while self.step < self.total_steps:
            batch = self.batch_for_step(self.step)
            metrics = self.training_step(batch, self.step)
            self.step += 1
            self.last_metrics = metrics
            progress.update(1)
            shown = {"reward": metrics.get("reward/final"), "loss": metrics["loss"], "s_per_step": metrics["time/step_s"]}
            progress.set_postfix({name: f"{value:.4g}" for name, value in shown.items() if value is not None})
            if cfg.eval_steps and self.step % cfg.eval_steps == 0 and self.step < self.total_steps and self.eval_data:
                self.last_scores = self.evaluate()
                metrics = {**metrics, **self.last_scores}
            if self.step % cfg.logging_steps == 0 or self.step == self.total_steps:
                self.metrics.log(self.step, metrics)
            if cfg.save_steps and self.step % cfg.save_steps == 0 and self.step < self.total_steps:
                self.save_checkpoint()
                saved_at = self.step
            if self.step >= stop or (deadline is not None and self.step < self.total_steps and self._past(deadline)):
                break
        progress.close()
        return self._finish(saved_at)

    def _claim_output_dir(self, resume: bool) -> RunFamily:
        """Take ``output_dir`` for this run (:func:`~grace_training.run_dir.claim_output_dir`): every
        process checks, so a refusal stops them all; the main one acts, the others read its marker."""
        settings = {
            "method": self.config.method,
            "resume": resume,
            "overwrite": self.overwrite_output_dir,
            "last_step": self.total_steps,
        }
        inspect_output_dir(self.config.output_dir, **settings)
        self.accelerator.wait_for_everyone()
        family = claim_output_dir(self.config.output_dir, **settings) if self.accelerator.is_main_process else None
        self.accelerator.wait_for_everyone()
        return family or read_family(self.config.output_dir)

    def _family(self) -> RunFamily | None:
        """The run's family; before train() claimed the directory, the one its marker names (if any)."""
        return self.run_family if self.run_family is not None else read_family(self.config.output_dir)

    def _finish(self, saved_at: int | None) -> dict[str, Any]:
        """The run's end (a final evaluation and checkpoint) or a chunk's (a checkpoint to resume from)."""
        done = self.step >= self.total_steps
        if done and self.eval_data and self.step > 0:
            self.last_scores = self.evaluate()
            self.metrics.log(self.step, self.last_scores)
        if saved_at != self.step:
            self.save_checkpoint(final=done)
        if not done:
            logger.info("chunk done at step %d of %d; --resume continues", self.step, self.total_steps)
        if self.pusher is not None:
            self._close_pusher()
        self.metrics.close()
        return {"step": self.step, "metrics": self.last_metrics, "scores": self.last_scores}

    def _past(self, deadline: float) -> bool:
        """Whether the chunk's time is up, as every process sees it (they stop at the same step)."""
        (late,) = sum_over_processes(self.accelerator, float(time.monotonic() >= deadline))
        return late > 0

    def _hub_pusher(self):
        from .hub import HubPusher

        cfg = self.config
        return HubPusher(
            cfg.hub_model_id,
            cfg.output_dir,
            api=self.hub_api,
            private=cfg.hub_private,
            initial_backoff=cfg.hub_retry_backoff_s,
        )

    def _close_pusher(self) -> None:
        """Wait (``hub_final_wait_s``) for pushes in flight; say what was not pushed and where it is kept."""
        if self.pusher.close(timeout=self.config.hub_final_wait_s):
            return
        if self.pusher.disabled:
            logger.error(
                "Hub pushes were disabled (%s); %s lists what was not pushed", self.pusher.disabled, self.pusher.journal
            )
        else:
            logger.warning("Hub pushes still pending; %s keeps them for the next run", self.pusher.journal)

    def training_step(self, batch: list[Triplet], step: int) -> dict[str, float]:
        """One GRPO step: Eq. 4 rollouts, Eqs. 5–9/13/28 rewards, Eq. 10 advantages, Eq. 11 update
        (with ``method: gircse``, one :meth:`soft_token_step` instead)."""
        if self.config.method == "gircse":
            return self.soft_token_step(batch, step)
        start, cpu_start = time.perf_counter(), time.process_time()
        scores = self.graded_scores(step)
        rollouts = self.rollout(batch, step)
        rolled = time.perf_counter()
        rewards = self.compute_rewards(rollouts)
        advantages = group_advantages(rewards["final"], self.config.scale_rewards)
        rewarded = time.perf_counter()
        update = self.update(rollouts, advantages.reshape(-1), scores)
        updated = time.perf_counter()
        self.last_example = {
            "text": batch[0].positive[:1000],
            "rationale": self.encoder.tokenizer.decode(rollouts.positives.rationale_ids[0], skip_special_tokens=False),
        }
        timings = {
            "rollout": rolled - start,
            "reward": rewarded - rolled,
            "update": updated - rewarded,
            "step": updated - start,
            "cpu": time.process_time() - cpu_start,  # CPU seconds of this process: the cost, whatever else ran
        }
        # Reward and advantage statistics over the global batch, the same on every process.
        rewards = {name: gather(self.accelerator, value) for name, value in rewards.items()}
        truncated = gather(self.accelerator, rollouts.positives.truncated.view(advantages.shape))
        metrics = step_metrics(
            rollouts, rewards, gather(self.accelerator, advantages), truncated, update, timings,
            config=self.config, epoch=(step + 1) / self.steps_per_epoch, accelerator=self.accelerator,
        )
        return reduce_metrics(self.accelerator, metrics)

    def soft_token_step(self, batch: list[Triplet], step: int) -> dict[str, float]:
        """One GIRCSE step (gircse.md): the batch's soft-token embeddings z_1..z_K with gradient, Eq. 7's
        stepwise InfoNCE (CoSENT for scored pairs) + λ · Eq. 8 (:func:`grace_training.gircse.icr_batch_loss`),
        one optimiser step. No rollouts, no rewards."""
        cfg = self.config
        start, cpu_start = time.perf_counter(), time.process_time()
        lr = self.scheduler.get_last_lr()[0]
        accelerator = self.accelerator
        self.policy_wrapped.train()
        self.optimizer.zero_grad(set_to_none=True)
        # The soft steps call the decoder and the LM head one at a time, not the wrapped model once, so
        # DDP's own all-reduce is kept out and the gradients are averaged over processes here.
        separate = accelerator.no_sync(self.policy_wrapped) if accelerator.num_processes > 1 else contextlib.nullcontext()
        with separate:
            with accelerator.autocast():
                parts = icr_batch_loss(
                    self.encoder, batch, cfg, self.graded_scores(step), accelerator.device, accelerator
                )
            forwarded = time.perf_counter()
            accelerator.backward(parts["loss"])
        if accelerator.num_processes > 1:
            for parameter in self.trainable_parameters():
                if parameter.grad is not None:
                    parameter.grad = accelerator.reduce(parameter.grad, reduction="mean")
        backwarded = time.perf_counter()
        max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
        grad_norm = self.accelerator.clip_grad_norm_(self.trainable_parameters(), max_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.policy_wrapped.eval()
        done = time.perf_counter()
        self.last_example = None  # a soft token has no text; explain() shows its trace
        return {
            "loss": parts["loss"].item(),
            "loss/contrastive": parts["contrastive"].item(),
            "loss/refinement": parts["refinement"].item(),
            **{f"loss/step_{k + 1}": float(v) for k, v in enumerate(parts["step_losses"].tolist())},
            "grad_norm": float(grad_norm),
            "lr": lr,
            "epoch": (step + 1) / self.steps_per_epoch,
            "time/update_forward_s": forwarded - start,
            "time/update_backward_s": backwarded - forwarded,
            "time/update_optimizer_s": done - backwarded,
            "time/step_s": done - start,
            # the step's CPU cost over every process, as a GRPO step's (the losses are global already)
            "time/step_cpu_s": sum_over_processes(accelerator, time.process_time() - cpu_start)[0],
        }

    # ------------------------------------------------------------------------------------------
    # stages
    # ------------------------------------------------------------------------------------------

    def batch_for_step(self, step: int) -> list[Triplet]:
        """This process's share of the step's global batch (:class:`~grace_training.sampling.BatchSchedule`)."""
        ids = self.schedule.batch(step)
        rank, local = self.accelerator.process_index, self.local_batch_size
        return [self.train_data[i] for i in ids[rank * local : (rank + 1) * local]]

    def graded_scores(self, step: int) -> torch.Tensor | None:
        """The gold scores of the step's global batch when it is one of scored pairs (an ``sts`` source:
        the graded term replaces InfoNCE), else None."""
        rows = [self.train_data[i] for i in self.schedule.batch(step)]
        if any(row.score is None for row in rows):
            return None
        return torch.tensor([row.score for row in rows], dtype=torch.float32)

    def rollout(self, batch: list[Triplet], step: int) -> TripletRollouts:
        """Eq. 4 (one rationale per query and negative, K per positive), embeddings by Eq. 3; one greedy
        rationale a text in a warm-start step or a step of scored pairs (:meth:`graded_scores`)."""
        cfg = self.config
        self.policy.eval()
        with self.accelerator.autocast():
            return asymmetric_rollouts(
                self.encoder,
                batch,
                step=step,
                generate=self.generate,
                instance_offset=self.accelerator.process_index * self.local_batch_size,
                **cfg.rollout_settings(step, graded=self.graded_scores(step) is not None),
            )

    def compute_rewards(self, rollouts: TripletRollouts) -> dict[str, torch.Tensor]:
        """Eqs. 5–9 (or 13 unsupervised) and 28 for every positive rollout, each (B, K)."""
        cfg = self.config
        query, positives, negatives, mask, truncated = rollouts.grouped(cfg.num_negatives)
        all_queries, all_positives, own = query, positives, None
        if self.accelerator.num_processes > 1:
            all_queries, all_positives = gather(self.accelerator, query), gather(self.accelerator, positives)
            own = torch.arange(len(query)) + self.accelerator.process_index * self.local_batch_size
        return compute_rewards(
            query,
            positives,
            negatives,
            mask,
            truncated,
            all_queries=all_queries,
            all_positives=all_positives,
            own_index=own,
            **cfg.reward_settings(),
        )

    def update(
        self, rollouts: TripletRollouts, advantages: torch.Tensor, scores: torch.Tensor | None = None
    ) -> dict[str, float]:
        """Eq. 11 on the positive rollouts: ``ppo_epochs`` optimiser steps, each accumulating
        ``gradient_accumulation_steps`` chunks; token-level aggregation over the whole batch.

        With ``contrastive_beta`` β > 0 the same pass pools the positives' hidden states (Eq. 3)
        and adds β · InfoNCE (:mod:`grace_training.hybrid`). Queries and negatives are the
        rollouts' embeddings (``contrastive_anchors: detached``) or recomputed with gradient
        (``recompute``). Within a chunk, the positives of other chunks act as in-batch negatives
        through their rollout embeddings (no gradient); one chunk is exact. A batch of scored pairs
        (``scores``) takes β · CoSENT instead (:func:`grace_training.hybrid.graded_pairs_loss`).
        """
        cfg, accelerator = self.config, self.accelerator
        lr = self.scheduler.get_last_lr()[0]  # the rate this step's update uses
        self.policy_wrapped.train()
        chunks, batches = self.policy_batches(rollouts.positives)
        # T of Eq. 11 counts the tokens of the global batch.
        (num_tokens,) = sum_over_processes(accelerator, float(sum(b["completion_mask"].sum() for b in batches)))
        hybrid = cfg.contrastive_beta > 0
        candidates = hybrid_candidates(rollouts, cfg.num_negatives, accelerator) if hybrid else None  # every chunk's
        advantages = advantages.to(accelerator.device)
        old_log_probs, ref_log_probs = self.fixed_log_probs(batches, rollouts.positives.temperature)
        ref_text, num_text = [None] * len(batches), 0.0
        if cfg.text_kl_coef > 0:
            ref_text = self.reference_text_log_probs(batches)
            (num_text,) = sum_over_processes(
                accelerator, float(sum(b["text_mask"][b["text_rows"]].sum() for b in batches))
            )

        totals = dict.fromkeys(("loss", "clip_fraction", "kl", "text_kl", "policy_loss", "contrastive_loss"), 0.0)
        seconds = dict.fromkeys(("forward", "backward", "optimizer"), 0.0)  # the step profile's parts
        grad_norm = torch.tensor(0.0)
        for _ in range(cfg.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for i, (batch, chunk) in enumerate(zip(batches, chunks)):
                last = i == len(batches) - 1
                sync = contextlib.nullcontext() if last else accelerator.no_sync(self.policy_wrapped)
                with sync, accelerator.autocast():
                    started = time.perf_counter()
                    loss, terms = self.chunk_loss(
                        rollouts, batch, chunk, advantages[chunk], old_log_probs[i], ref_log_probs[i], num_tokens,
                        candidates, scores, ref_text[i], num_text,
                    )
                    forwarded = time.perf_counter()
                    # DDP and FSDP average gradients over processes: scaled by their number, that
                    # average is the gradient of one process holding the whole batch.
                    accelerator.backward(loss * accelerator.num_processes)
                    seconds["forward"] += forwarded - started
                    seconds["backward"] += time.perf_counter() - forwarded
                share = batch["completion_mask"].sum().item() / max(num_tokens, 1.0)
                for name, value in terms.items():
                    totals[name] += value * (share if name in ("clip_fraction", "kl") else 1.0) / cfg.ppo_epochs
            started = time.perf_counter()
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
            grad_norm = accelerator.clip_grad_norm_(self.trainable_parameters(), max_norm)
            self.optimizer.step()
            seconds["optimizer"] += time.perf_counter() - started
        self.scheduler.step()
        self.policy_wrapped.eval()
        return {
            **totals,
            "lr": lr,
            "grad_norm": float(grad_norm),
            "trained_tokens": num_tokens,
            "update_tokens": float(sum(b["attention_mask"].sum() for b in batches)),
            "weight_sync_s": self.sync_rollout_engine(),
            "seconds": seconds,
        }

    def policy_batches(self, positives: RolloutBatch) -> tuple[list[list[int]], list[dict[str, torch.Tensor]]]:
        """The positive rollouts as ``gradient_accumulation_steps`` chunks of rows and their
        policy batches (:func:`~grace_training.grpo.build_policy_batch`), on the device.

        Contiguous blocks of rows (whole instances when the chunk count divides B), as the
        processes split the global batch: the hybrid term then treats another chunk and another
        process alike, and one process with n chunks computes what n processes do.
        """
        cfg = self.config
        rows = list(range(len(positives)))
        parts = min(cfg.gradient_accumulation_steps, len(rows))
        chunks = [rows[len(rows) * i // parts : len(rows) * (i + 1) // parts] for i in range(parts)]
        batches = []
        for chunk in chunks:
            batch = build_policy_batch(
                [positives.prompt_ids[i] for i in chunk],
                [positives.rationale_ids[i] for i in chunk],
                [positives.stop_ids[i] for i in chunk],
                self.encoder.pad_token_id,
                [positives.instruction_lengths[i] for i in chunk]
                if cfg.contrastive_beta > 0 or cfg.text_kl_coef > 0
                else None,
                share_prompts=cfg.share_prompt_pass and not cfg.gradient_checkpointing,
            )
            if cfg.mask_truncated:  # DAPO / TRL: a rationale cut at the limit is no evidence either way
                cut = positives.truncated[chunk].to(batch["completion_mask"].device)
                batch["completion_mask"] &= ~cut[:, None]
            batches.append({k: v.to(self.accelerator.device) for k, v in batch.items()})
        return chunks, batches

    def fixed_log_probs(self, batches: list[dict[str, torch.Tensor]], temperature: float) -> tuple[list, list]:
        """Per chunk, log π_old (only with ``ppo_epochs`` > 1; otherwise the ratio of Eq. 11 is
        taken against the current pass, detached) and log π_ref (only with ``kl_coef`` > 0)."""
        cfg = self.config
        old_log_probs, ref_log_probs = [None] * len(batches), [None] * len(batches)
        if cfg.ppo_epochs > 1 or cfg.kl_coef > 0:
            with torch.no_grad(), self.accelerator.autocast():
                for i, batch in enumerate(batches):
                    if cfg.ppo_epochs > 1:
                        old_log_probs[i] = completion_log_probs(self.policy_wrapped, batch, temperature)
                    if cfg.kl_coef > 0:
                        ref_log_probs[i] = self.reference_log_probs(batch, temperature)
        return old_log_probs, ref_log_probs

    def chunk_loss(
        self, rollouts, batch, chunk, advantages, old_log_probs, ref_log_probs, num_tokens, candidates, scores=None,
        ref_text=None, num_text=0.0,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """One chunk's loss with gradient: Eq. 11 (:func:`~grace_training.grpo.grpo_loss`), plus
        β · the hybrid term over the same pass's pooled states (CoSENT for a batch of scored pairs),
        plus ``text_kl_coef`` · KL to the reference over the text's positions
        (:func:`~grace_training.grpo.text_kl`); and its parts as numbers."""
        cfg = self.config
        hybrid = cfg.contrastive_beta > 0
        temperature = rollouts.positives.temperature
        log_probs, pooled, text_logits = policy_pass(
            self.policy_wrapped,
            batch,
            temperature,
            pool_from=self.policy if hybrid else None,
            hidden_layer=self.encoder.hidden_layer,
            text=ref_text is not None,
        )
        old = old_log_probs if old_log_probs is not None else log_probs.detach()
        loss, stats = grpo_loss(
            log_probs,
            old,
            advantages,
            batch["completion_mask"],
            clip_epsilon=cfg.clip_epsilon,
            ref_log_probs=ref_log_probs,
            kl_coef=cfg.kl_coef,
            num_tokens=num_tokens,
        )
        policy_loss = loss.detach()
        contrastive = torch.zeros((), device=self.accelerator.device)
        if hybrid and scores is not None:
            contrastive = graded_pairs_loss(candidates, rollouts, chunk, pooled, scores, cfg, self.accelerator.process_index)
            loss = loss + cfg.contrastive_beta * contrastive
        elif hybrid:

            def recompute() -> torch.Tensor:
                anchors = (rollouts.queries, rollouts.negatives)
                encoder = self.encoder
                device = self.accelerator.device
                return pooled_with_grad(
                    self.policy_wrapped, self.policy, anchors, encoder.pad_token_id, encoder.hidden_layer, device,
                    prompts_only=cfg.contrastive_anchors == "recompute_prompts",
                )

            recomputed = recompute if cfg.contrastive_anchors != "detached" else None
            contrastive = hybrid_contrastive_loss(
                candidates, rollouts, chunk, pooled, cfg, self.accelerator.process_index, recomputed
            ) / (len(rollouts.positives) * self.accelerator.num_processes)
            loss = loss + cfg.contrastive_beta * contrastive
        held = torch.zeros((), device=self.accelerator.device)
        if ref_text is not None:
            held = text_kl(text_logits, ref_text, batch["text_mask"][batch["text_rows"]], num_text)
            loss = loss + cfg.text_kl_coef * held
        terms = {
            "loss": loss.item(),
            "policy_loss": policy_loss.item(),
            "contrastive_loss": contrastive.item(),
            "clip_fraction": stats["clip_fraction"].item(),
            "kl": stats.get("kl", torch.tensor(0.0)).item(),
            "text_kl": held.item(),
        }
        return loss, terms

    def sync_rollout_engine(self) -> float:
        """Copy the updated weights into the vLLM engine (none with HF rollouts); seconds taken."""
        synced = time.perf_counter()
        if self.engine is not None:
            self.engine.sync_from(self.policy)
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the copies are asynchronous: time them to the end
        return time.perf_counter() - synced

    def reference_log_probs(self, batch: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
        """log π_ref for the KL term: the frozen copy (full fine-tuning) or the adapter disabled (LoRA)."""
        if self.reference is not None:
            return completion_log_probs(self.reference, batch, temperature)
        with self.policy.disable_adapter():
            return completion_log_probs(self.policy_wrapped, batch, temperature)

    def reference_text_log_probs(self, batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Per chunk, the reference's next-token log-probabilities over the prompts' positions, for
        ``text_kl_coef``: the frozen copy (full fine-tuning) or the adapter disabled (LoRA)."""
        with torch.no_grad(), self.accelerator.autocast():
            if self.reference is not None:
                return [text_log_probs(self.reference, batch) for batch in batches]
            with self.policy.disable_adapter():
                return [text_log_probs(self.policy_wrapped, batch) for batch in batches]

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.policy_wrapped.parameters() if p.requires_grad]

    # ------------------------------------------------------------------------------------------
    # metrics, evaluation
    # ------------------------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Greedy ``encode`` scores on the eval sources (see evaluation.py)."""
        cfg = self.config
        start = time.perf_counter()
        with self.accelerator.autocast():
            scores = evaluate(
                self.st_model,
                self.eval_data,
                query_task=cfg.query_task,
                document_task=cfg.document_task,
                batch_size=cfg.eval_batch_size,
            )
        scores["time/eval_s"] = time.perf_counter() - start
        logger.info("eval at step %d: %s", self.step, scores)
        return scores

    # ------------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------------

    def save_checkpoint(self, final: bool = False) -> Path:
        """A GRACE model directory + trainer state at ``output_dir/checkpoint-<step>``, atomically."""
        from grace_st.model_cards import write_model_card

        cfg = self.config
        distributed = self.accelerator.num_processes > 1
        full_state = self.accelerator.get_state_dict(self.policy_wrapped) if distributed else None
        epoch, index = divmod(self.step, self.steps_per_epoch)
        state = {
            "step": self.step,
            "total_steps": self.total_steps,
            "steps_per_epoch": self.steps_per_epoch,
            "data_position": {"epoch": epoch, "batch_in_epoch": index, "num_instances": len(self.train_data)},
            "config": cfg.to_dict(),
            "metrics": self.last_metrics,
            "scores": self.last_scores,
            "example": self.last_example,
        }

        def card(path: Path) -> None:
            scores = {k.removeprefix("eval/"): v for k, v in self.last_scores.items() if k.startswith("eval/")}
            write_model_card(
                self.st_model,
                path,
                model_id=cfg.hub_model_id or Path(cfg.output_dir).name,
                base_model=self.base_model,
                example=self.last_example,
                training_config={**cfg.summary(), "step": self.step},
                scores=scores or None,
            )

        family = self._family()
        path = write_checkpoint(
            cfg.output_dir,
            self.step,
            write_model=lambda target: save_model_dir(self.st_model, target, full_state),
            write_extra=card,
            trainer_state=state,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            accelerator=self.accelerator,
            family=family,
        )
        if self.accelerator.is_main_process:
            if self.pusher is not None and (final or not cfg.push_steps or self.step % cfg.push_steps == 0):
                self.pusher.submit(path, self.step)
            protected = self.pusher.pending_paths() if self.pusher is not None else set()
            rotate_checkpoints(cfg.output_dir, cfg.save_total_limit, protected, family)
        return path

    def resume(self, checkpoint: str | Path | None = None) -> int:
        """Restore weights, optimizer, scheduler, RNG and data position; returns the step.

        Without ``checkpoint``: the newest checkpoint of this run in ``output_dir`` that loads. Each
        one that does not is logged with its reason and renamed ``corrupt-checkpoint-*`` (kept, but
        out of keep-last-k's count); none loadable raises :class:`CheckpointError` listing them. A
        ``checkpoint`` named explicitly is loaded or refused, never swapped for another.

        The config is compared with the checkpoint's before anything loads: a change that is not
        free raises :class:`~grace_training.run_dir.ConfigChangeError` (see ``config.RESUME_CHANGES``),
        unless ``allow_config_change``; every change is then applied and recorded.
        """
        if checkpoint:
            path = Path(checkpoint)
            state = self._load_checkpoint(path)
        else:
            path, state = load_newest_loadable(
                self.config.output_dir, self._load_checkpoint, self.accelerator, self._family()
            )
            if path is None:
                logger.warning("--resume: no checkpoint in %s, starting from step 0", self.config.output_dir)
                return 0
        self.step = int(state["step"])
        self.last_metrics = state.get("metrics") or {}
        self.last_scores = state.get("scores") or {}
        self._apply_config_changes(path, state)
        if self.engine is not None:
            self.engine.sync_from(self.policy)
        logger.info("resumed from %s at step %d", path, self.step)
        return self.step

    def _apply_config_changes(self, path: Path, state: dict[str, Any]) -> None:
        """The config changed since the checkpoint (and passed :meth:`_check_config`): what the
        optimizer and the schedule restored is set to the config's, and each change is recorded."""
        changes = config_changes(saved_config(state, self.config.output_dir), self.config)
        if not changes:
            return
        if OPTIMIZER_KEYS & {change.key for change in changes}:
            self._apply_optimizer_settings()
        logger.warning("--resume: config changed since %s, from step %d: %s", path, self.step + 1,
                       "; ".join(map(str, changes)))
        if self.accelerator.is_main_process:
            record_config_changes(self.config.output_dir, self.step, path, changes)

    def _apply_optimizer_settings(self) -> None:
        """A loaded optimizer holds the checkpoint's rate, betas, eps and weight decay, and the
        schedule its base rate: set them to the config's, and the current rate to the (possibly
        new) schedule's value at this step, so the next update uses what the record says."""
        cfg, scheduler = self.config, self.scheduler
        groups = self.optimizer.param_groups
        for group in groups:
            group.update(
                betas=(cfg.adam_beta1, cfg.adam_beta2),
                eps=cfg.adam_epsilon,
                weight_decay=cfg.weight_decay,
                initial_lr=cfg.learning_rate,
            )
        scheduler.base_lrs = [cfg.learning_rate] * len(groups)
        rates = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        for group, rate in zip(groups, rates):
            group["lr"] = rate
        scheduler._last_lr = rates  # what get_last_lr() reports; LambdaLR sets it in step()

    def _check_config(self, path: Path, state: dict[str, Any]) -> None:
        """Refuse a config change the checkpoint's record could not tell (before any weight is touched)."""
        changes = config_changes(saved_config(state, self.config.output_dir), self.config)
        check_config_changes(changes, allowed=self.allow_config_change, checkpoint=path, step=int(state["step"]))

    def _load_checkpoint(self, path: Path) -> dict[str, Any]:
        # A checkpoint that cannot load is skipped (CheckpointError) before its config is compared.
        self._check_config(path, check_checkpoint(path))
        state = load_checkpoint(
            path, policy=self.policy, optimizer=self.optimizer, scheduler=self.scheduler, accelerator=self.accelerator
        )
        if state.get("steps_per_epoch") not in (None, self.steps_per_epoch):
            logger.warning(
                "the data changed since the checkpoint (%s batches an epoch, now %s): the order differs",
                state["steps_per_epoch"],
                self.steps_per_epoch,
            )
        return state


def build_optimizer(policy, config: GRPOConfig) -> torch.optim.Optimizer:
    """AdamW over the policy's trainable parameters (the adapter's alone with LoRA)."""
    return torch.optim.AdamW(
        [p for p in policy.parameters() if p.requires_grad],
        lr=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_epsilon,
        weight_decay=config.weight_decay,
    )


def lr_schedule(config: GRPOConfig, total_steps: int):
    """Multiplier of the learning rate at a step: constant (paper), or linear decay; optional warm-up."""

    def factor(step: int) -> float:
        if config.warmup_steps and step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.lr_scheduler == "linear":
            return max(0.0, 1.0 - step / max(total_steps, 1))
        return 1.0

    return factor


def _progress_bar(method: str, total: int, initial: int, disable: bool):
    """Named after the method trained (a GIRCSE run labelled "GRPO" would misstate what it does)."""
    from tqdm.auto import tqdm

    desc = {"grace": "GRACE (GRPO)", "gircse": "GIRCSE (ICR)"}.get(method, method)
    return tqdm(total=total, initial=initial, disable=disable, desc=desc, unit="step", dynamic_ncols=True)
