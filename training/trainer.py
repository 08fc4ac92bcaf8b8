"""The GRACE GRPO loop (method.md §2): rollout → embed → reward → advantage → update.

Read :meth:`GRPOTrainer.train` top to bottom; each stage is a method a test can call alone:

- :meth:`~GRPOTrainer.batch_for_step`: the step's B triplets (a seeded order per epoch, so the
  data position is the step number and a resumed run sees the batches a straight run would);
- :meth:`~GRPOTrainer.rollout`: Eq. 4 with embeddings by Eq. 3 (no gradient);
- :meth:`~GRPOTrainer.compute_rewards`: Eqs. 5–9, 13, 28;
- :func:`grace_training.grpo.group_advantages`: Eq. 10;
- :meth:`~GRPOTrainer.update`: Eq. 11, one optimiser step (or ``ppo_epochs`` clipped ones), plus
  β · :func:`grace_training.grpo.pooled_contrastive_loss` on the same pass's pooled states when
  ``contrastive_beta`` > 0 (the hybrid objective; β = 0 is the paper's GRACE);
- :meth:`~GRPOTrainer.save_checkpoint` / :meth:`~GRPOTrainer.resume`.

Processes: ``accelerate`` runs it as one process, several CPU processes over gloo (DDP, tested
equal to one process), or several GPUs (DDP or FSDP2); see docs/training.md. The global batch is
split evenly across processes; the in-batch terms (Eq. 7, the hybrid InfoNCE) see every process's
rollouts through a gather, and Eq. 11's token count is the global batch's.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import random
import time
from pathlib import Path
from typing import Any

import torch

from .checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    remove_incomplete,
    rotate_checkpoints,
    save_model_dir,
    set_aside_corrupt,
    write_checkpoint,
)
from .config import ConfigError, GRPOConfig, LaunchError, check_batches, check_environment, check_launch
from .data import Triplet, load_data
from .evaluation import evaluate
from .grpo import (
    advantage_shares,
    build_policy_batch,
    completion_log_probs,
    group_advantages,
    grpo_loss,
    policy_pass,
    pooled_contrastive_loss,
)
from .metrics import MetricsLogger
from .policy import card_base_model, load_grace_model
from .rewards import compute_rewards, reward_parts
from .rollout import TripletRollouts, asymmetric_rollouts, hf_generate
from .rollout_batch import RolloutBatch

logger = logging.getLogger(__name__)


class GRPOTrainer:
    """GRPO with contrastive rewards over a GRACE SentenceTransformer's causal LM.

    Args:
        config: the run's settings (paper defaults).
        model: a GRACE SentenceTransformer (``grace_st.from_causal_lm`` or loaded); default:
            ``config.model_name_or_path``, or the embedded default model.
        train_data, eval_data: lists of :class:`~grace_training.data.Triplet`; default: loaded
            from ``config.train_data`` / ``config.eval_data``.
        hub_api: a stand-in for ``huggingface_hub.HfApi`` (tests); default: the real one.
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
    ) -> None:
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        config.validate()
        check_environment(config)
        check_launch()
        self.config = config
        self.accelerator = accelerator or Accelerator(
            cpu=_processes_without_a_gpu(), mixed_precision="bf16" if config.bf16 else "no"
        )
        _check_sharding(self.accelerator, config)

        # -- data (before the model: a run the data cannot feed is refused without loading it) --
        data_options = {
            "bad_rows": config.bad_rows,
            "data_dir": config.data_dir,
            "num_negatives": config.num_negatives,
            "seed": config.seed,
        }
        if train_data is None:
            train_data, _ = load_data(config.train_data, objective=config.objective, **data_options)
        if eval_data is None and config.eval_data:
            eval_data, _ = load_data(config.eval_data, **data_options)
        self.train_data = list(train_data)
        self.eval_data = _cap_per_source(eval_data or [], config.eval_max_examples, config.seed)
        world = self.accelerator.num_processes
        check_batches(config, len(self.train_data), world)
        self.local_batch_size = config.batch_size // world
        self.steps_per_epoch = len(self.train_data) // config.batch_size
        self.total_steps = config.max_steps if config.max_steps > 0 else config.epochs * self.steps_per_epoch
        self._orders: dict[int, list[int]] = {}

        # -- model --------------------------------------------------------------------------
        set_seed(config.seed)
        self.st_model = model if model is not None else load_grace_model(config, str(self.accelerator.device))
        self.encoder = self.st_model[0]
        # The saved model encodes with the prompt and rationale budget it was trained with.
        self.encoder.max_input_tokens = config.max_prompt_tokens
        self.encoder.max_rationale_tokens = config.max_response_tokens
        if config.finetune == "lora":
            self.encoder.model = add_lora_adapter(self.encoder.model, config)
        self.policy = self.encoder.model
        if config.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()

        # -- optimisation -------------------------------------------------------------------
        # KL reference: with LoRA the base is the adapter disabled (no second copy in memory).
        self.reference = None
        if config.kl_coef > 0 and config.finetune == "full":
            self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        optimizer = torch.optim.AdamW(
            [p for p in self.policy.parameters() if p.requires_grad],
            lr=config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_epsilon,
            weight_decay=config.weight_decay,
        )
        # The scheduler is stepped once per training step here, not through accelerate (which
        # would step it once per process).
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(config, self.total_steps))
        self.policy_wrapped, self.optimizer = self.accelerator.prepare(self.policy, optimizer)

        # -- rollout backend ----------------------------------------------------------------
        self.engine = None
        self.generate = lambda *a, **kw: hf_generate(self.encoder, *a, batch_size=config.rollout_batch_size, **kw)
        if config.rollout_backend == "vllm":
            self.engine = self._build_vllm_engine()
            self.generate = self.engine.generate

        self.hub_api = hub_api
        self.pusher = None
        self.metrics: MetricsLogger | None = None
        self.step = 0
        self.last_metrics: dict[str, Any] = {}
        self.last_scores: dict[str, float] = {}
        self.last_example: dict[str, str] | None = None
        self.base_model = card_base_model(config)

    # ------------------------------------------------------------------------------------------
    # the loop
    # ------------------------------------------------------------------------------------------

    def train(self, resume: bool | str = False) -> dict[str, Any]:
        """Run to ``total_steps``; with ``resume``, continue the latest (or given) checkpoint's trajectory."""
        cfg, main = self.config, self.accelerator.is_main_process
        if main:
            for path in remove_incomplete(cfg.output_dir):
                logger.warning("removed an incomplete checkpoint left by a crash: %s", path)
        self.accelerator.wait_for_everyone()  # every process lists checkpoints after the cleanup
        if resume:
            self.resume(None if resume is True else resume)
            if self.step >= self.total_steps:
                logger.info("the checkpoint at step %d already completes the run", self.step)
                return {"step": self.step, "metrics": self.last_metrics, "scores": self.last_scores}
        self.metrics = MetricsLogger(
            cfg.output_dir, cfg.report_to, enabled=main, resume_step=self.step if resume else None
        )
        if cfg.push_to_hub and main:
            from .hub import HubPusher

            self.pusher = HubPusher(
                cfg.hub_model_id,
                cfg.output_dir,
                api=self.hub_api,
                private=cfg.hub_private,
                initial_backoff=cfg.hub_retry_backoff_s,
            )
        if self.step == 0 and self.eval_data:
            self.last_scores = self.evaluate()
            self.metrics.log(0, self.last_scores)
        progress = _progress_bar(self.total_steps, self.step, disable=not main)
        saved_at = None
        while self.step < self.total_steps:
            batch = self.batch_for_step(self.step)
            metrics = self.training_step(batch, self.step)
            self.step += 1
            self.last_metrics = metrics
            progress.update(1)
            progress.set_postfix(
                reward=f"{metrics['reward/final']:.3f}",
                loss=f"{metrics['loss']:.4f}",
                s_per_step=f"{metrics['time/step_s']:.1f}",
            )
            if cfg.eval_steps and self.step % cfg.eval_steps == 0 and self.step < self.total_steps and self.eval_data:
                self.last_scores = self.evaluate()
                metrics = {**metrics, **self.last_scores}
            if self.step % cfg.logging_steps == 0 or self.step == self.total_steps:
                self.metrics.log(self.step, metrics)
            if cfg.save_steps and self.step % cfg.save_steps == 0 and self.step < self.total_steps:
                self.save_checkpoint()
                saved_at = self.step
        progress.close()
        if self.eval_data and self.step > 0:
            self.last_scores = self.evaluate()
            self.metrics.log(self.step, self.last_scores)
        if saved_at != self.step:
            self.save_checkpoint(final=True)
        if self.pusher is not None and not self.pusher.close(timeout=cfg.hub_final_wait_s):
            if self.pusher.disabled:
                logger.error(
                    "Hub pushes were disabled (%s); %s lists what was not pushed",
                    self.pusher.disabled,
                    self.pusher.journal,
                )
            else:
                logger.warning("Hub pushes still pending; %s keeps them for the next run", self.pusher.journal)
        self.metrics.close()
        return {"step": self.step, "metrics": self.last_metrics, "scores": self.last_scores}

    def training_step(self, batch: list[Triplet], step: int) -> dict[str, float]:
        """One GRPO step: Eq. 4 rollouts, Eqs. 5–9/13/28 rewards, Eq. 10 advantages, Eq. 11 update."""
        start = time.perf_counter()
        rollouts = self.rollout(batch, step)
        rolled = time.perf_counter()
        rewards = self.compute_rewards(rollouts)
        advantages = group_advantages(rewards["final"], self.config.scale_rewards)
        rewarded = time.perf_counter()
        update = self.update(rollouts, advantages.reshape(-1))
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
        }
        # Reward and advantage statistics over the global batch, the same on every process.
        rewards = {name: self._gather(value) for name, value in rewards.items()}
        truncated = self._gather(rollouts.positives.truncated.view(advantages.shape))
        metrics = self.step_metrics(rollouts, rewards, self._gather(advantages), truncated, update, timings, step)
        return self._reduce(metrics)

    # ------------------------------------------------------------------------------------------
    # stages
    # ------------------------------------------------------------------------------------------

    def batch_for_step(self, step: int) -> list[Triplet]:
        """This process's share of the step's global batch (seeded order per epoch)."""
        epoch, index = divmod(step, self.steps_per_epoch)
        if epoch not in self._orders:
            order = list(range(len(self.train_data)))
            random.Random(self.config.seed + epoch).shuffle(order)
            self._orders = {epoch: order}
        ids = self._orders[epoch][index * self.config.batch_size : (index + 1) * self.config.batch_size]
        rank, local = self.accelerator.process_index, self.local_batch_size
        return [self.train_data[i] for i in ids[rank * local : (rank + 1) * local]]

    def rollout(self, batch: list[Triplet], step: int) -> TripletRollouts:
        """Eq. 4 (one rationale per query and negative, K per positive), embeddings by Eq. 3."""
        cfg = self.config
        self.policy.eval()
        with self.accelerator.autocast():
            return asymmetric_rollouts(
                self.encoder,
                batch,
                num_rollouts=cfg.num_rollouts,
                num_negatives=cfg.num_negatives,
                step=step,
                seed=cfg.seed,
                max_new_tokens=cfg.max_response_tokens,
                temperature_query=cfg.temperature_query,
                temperature_negative=cfg.temperature_negative,
                temperature_positive=cfg.temperature_positive,
                top_p=cfg.top_p,
                query_task=cfg.query_task,
                document_task=cfg.document_task,
                generate=self.generate,
                instance_offset=self.accelerator.process_index * self.local_batch_size,
            )

    def compute_rewards(self, rollouts: TripletRollouts) -> dict[str, torch.Tensor]:
        """Eqs. 5–9 (or 13 unsupervised) and 28 for every positive rollout, each (B, K)."""
        cfg = self.config
        query, positives, negatives, mask, truncated = rollouts.grouped(cfg.num_negatives)
        all_queries, all_positives, own = query, positives, None
        if self.accelerator.num_processes > 1:
            all_queries, all_positives = self._gather(query), self._gather(positives)
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
            mode=cfg.reward_mode,
            objective=cfg.objective,
            lambda_consistency=cfg.lambda_consistency,
            lambda_hard_negative=cfg.lambda_hard_negative,
            tau=cfg.tau,
            gamma=cfg.gamma,
            length_penalty_mode=cfg.length_penalty_mode,
            length_penalty_units=cfg.length_penalty_units,
        )

    def update(self, rollouts: TripletRollouts, advantages: torch.Tensor) -> dict[str, float]:
        """Eq. 11 on the positive rollouts: ``ppo_epochs`` optimiser steps, each accumulating
        ``gradient_accumulation_steps`` chunks; token-level aggregation over the whole batch.

        With ``contrastive_beta`` β > 0 the same pass pools the positives' hidden states (Eq. 3)
        and adds β · InfoNCE (:func:`~grace_training.grpo.pooled_contrastive_loss`). Queries and
        negatives are the rollouts' embeddings (``contrastive_anchors: detached``) or recomputed
        with gradient (``recompute``). Within a chunk, the positives of other chunks act as
        in-batch negatives through their rollout embeddings (no gradient); one chunk is exact.
        """
        cfg, accelerator = self.config, self.accelerator
        positives = rollouts.positives
        device = accelerator.device
        lr = self.scheduler.get_last_lr()[0]  # the rate this step's update uses
        hybrid = cfg.contrastive_beta > 0
        self.policy_wrapped.train()
        rows = list(range(len(positives)))
        parts = min(cfg.gradient_accumulation_steps, len(rows))
        # Contiguous blocks of rows (whole instances when the chunk count divides B), as the processes
        # split the global batch: the hybrid term then treats another chunk and another
        # process alike, and one process with n chunks computes what n processes do.
        chunks = [rows[len(rows) * i // parts : len(rows) * (i + 1) // parts] for i in range(parts)]
        batches = []
        for chunk in chunks:
            batch = build_policy_batch(
                [positives.prompt_ids[i] for i in chunk],
                [positives.rationale_ids[i] for i in chunk],
                [positives.stop_ids[i] for i in chunk],
                self.encoder.pad_token_id,
                [positives.instruction_lengths[i] for i in chunk] if hybrid else None,
            )
            if cfg.mask_truncated:  # DAPO / TRL: a rationale cut at the limit is no evidence either way
                cut = positives.truncated[chunk].to(batch["completion_mask"].device)
                batch["completion_mask"] &= ~cut[:, None]
            batches.append({k: v.to(device) for k, v in batch.items()})
        # T of Eq. 11 counts the tokens of the global batch; DDP and FSDP average gradients over
        # processes, so each process's loss is scaled by their number to make that average the
        # gradient of one process holding the whole batch.
        (num_tokens,) = self._sum_over_processes(float(sum(b["completion_mask"].sum() for b in batches)))
        world = accelerator.num_processes
        rows_everywhere = len(positives) * world
        candidates = self.hybrid_candidates(rollouts) if hybrid else None  # gathered once, every chunk's
        advantages = advantages.to(device)
        temperature = positives.temperature

        old_log_probs, ref_log_probs = [None] * parts, [None] * parts
        if cfg.ppo_epochs > 1 or cfg.kl_coef > 0:
            with torch.no_grad(), accelerator.autocast():
                for i, batch in enumerate(batches):
                    if cfg.ppo_epochs > 1:
                        old_log_probs[i] = completion_log_probs(self.policy_wrapped, batch, temperature)
                    if cfg.kl_coef > 0:
                        ref_log_probs[i] = self.reference_log_probs(batch, temperature)

        totals = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "policy_loss": 0.0, "contrastive_loss": 0.0}
        grad_norm = torch.tensor(0.0)
        for _ in range(cfg.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for i, (batch, chunk) in enumerate(zip(batches, chunks)):
                last = i == len(batches) - 1
                sync = contextlib.nullcontext() if last else accelerator.no_sync(self.policy_wrapped)
                with sync, accelerator.autocast():
                    log_probs, pooled = policy_pass(
                        self.policy_wrapped,
                        batch,
                        temperature,
                        pool_from=self.policy if hybrid else None,
                        hidden_layer=self.encoder.hidden_layer,
                    )
                    old = old_log_probs[i] if old_log_probs[i] is not None else log_probs.detach()
                    loss, stats = grpo_loss(
                        log_probs,
                        old,
                        advantages[chunk],
                        batch["completion_mask"],
                        clip_epsilon=cfg.clip_epsilon,
                        ref_log_probs=ref_log_probs[i],
                        kl_coef=cfg.kl_coef,
                        num_tokens=num_tokens,
                    )
                    policy_loss = loss.detach()
                    contrastive = torch.zeros((), device=device)
                    if hybrid:
                        contrastive = (
                            self.hybrid_contrastive_loss(candidates, rollouts, chunk, pooled) / rows_everywhere
                        )
                        loss = loss + cfg.contrastive_beta * contrastive
                    accelerator.backward(loss * world)
                share = batch["completion_mask"].sum().item() / max(num_tokens, 1.0)
                totals["loss"] += loss.item() / cfg.ppo_epochs
                totals["policy_loss"] += policy_loss.item() / cfg.ppo_epochs
                totals["contrastive_loss"] += contrastive.item() / cfg.ppo_epochs
                totals["clip_fraction"] += stats["clip_fraction"].item() * share / cfg.ppo_epochs
                totals["kl"] += stats.get("kl", torch.tensor(0.0)).item() * share / cfg.ppo_epochs
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
            grad_norm = accelerator.clip_grad_norm_(self.trainable_parameters(), max_norm)
            self.optimizer.step()
        self.scheduler.step()
        self.policy_wrapped.eval()
        synced = time.perf_counter()
        if self.engine is not None:
            self.engine.sync_from(self.policy)
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the copies are asynchronous: time them to the end
        weight_sync_s = time.perf_counter() - synced
        return {
            **totals,
            "lr": lr,
            "grad_norm": float(grad_norm),
            "trained_tokens": num_tokens,
            "update_tokens": float(sum(b["attention_mask"].sum() for b in batches)),
            "weight_sync_s": weight_sync_s,
        }

    def hybrid_candidates(self, rollouts: TripletRollouts) -> tuple[torch.Tensor, ...]:
        """The rollout embeddings the hybrid term scores against: (queries (B, H), positives
        (B, K, H), negatives (B, M, H), negative mask (B, M)) of the global batch, on the device.
        Several processes: gathered, in process order."""
        grouped = rollouts.grouped(self.config.num_negatives)[:4]
        return tuple(self._gather(t).to(self.accelerator.device) for t in grouped)

    def hybrid_contrastive_loss(
        self, candidates: tuple[torch.Tensor, ...], rollouts: TripletRollouts, chunk: list[int], pooled: torch.Tensor
    ) -> torch.Tensor:
        """The hybrid term for one chunk of positive rows (summed; the caller divides by B·K).

        ``pooled`` are the chunk's positives pooled with gradient; every other embedding is the
        rollout's from ``candidates`` (:meth:`hybrid_candidates`: Eq. 3 under no_grad, the same
        value before the optimiser step), except this process's queries and negatives under
        ``contrastive_anchors: recompute``, pooled here with gradient.
        """
        cfg = self.config
        query, positives, negatives, mask = candidates
        device = pooled.device
        local, k = len(rollouts.queries), rollouts.num_rollouts
        # Several processes: this process's rows sit at its offset and carry gradient; the
        # others' act as another chunk's would (no gradient).
        offset = self.accelerator.process_index * local
        batch = positives.shape[0]
        index = torch.tensor([offset * k + row for row in chunk], device=device)
        flat = positives.reshape(batch * k, -1).to(dtype=pooled.dtype).index_copy(0, index, pooled)
        selected = torch.zeros(batch * k, dtype=torch.bool, device=device)
        selected[index] = True
        if cfg.contrastive_anchors == "recompute":
            # One forward for queries and negatives: every process runs the same number of passes
            # (each DDP or FSDP forward is a collective), whether or not its instances have negatives.
            fresh = self.pooled_with_grad(rollouts.queries, rollouts.negatives)
            mine = torch.arange(offset, offset + local, device=device)
            query = query.to(pooled.dtype).index_copy(0, mine, fresh[:local])
            fresh = fresh[local:]
            slots = rollouts.negative_slots(cfg.num_negatives)
            if slots:
                rows = [row for row, _, _ in slots]
                targets = [(offset + owner) * cfg.num_negatives + slot for _, owner, slot in slots]
                targets = torch.tensor(targets, device=device)
                negatives = negatives.reshape(batch * cfg.num_negatives, -1).to(fresh.dtype)
                negatives = negatives.index_copy(0, targets, fresh[rows])
                negatives = negatives.reshape(batch, cfg.num_negatives, -1)
        return pooled_contrastive_loss(
            query,
            flat.reshape(batch, k, -1),
            negatives,
            mask,
            temperature=cfg.contrastive_temperature,
            rows=selected.reshape(batch, k),
        )

    def pooled_with_grad(self, *parts: RolloutBatch) -> torch.Tensor:
        """Eq. 3 embeddings of rollouts (queries, negatives) recomputed with gradient, in one pass, in order."""
        batch = build_policy_batch(
            [ids for part in parts for ids in part.prompt_ids],
            [ids for part in parts for ids in part.rationale_ids],
            [stop for part in parts for stop in part.stop_ids],
            self.encoder.pad_token_id,
            [length for part in parts for length in part.instruction_lengths],
        )
        batch = {k: v.to(self.accelerator.device) for k, v in batch.items()}
        # the temperature scales log-probs only, which are not used here
        return policy_pass(
            self.policy_wrapped,
            batch,
            parts[0].temperature,
            pool_from=self.policy,
            hidden_layer=self.encoder.hidden_layer,
        )[1]

    def reference_log_probs(self, batch: dict[str, torch.Tensor], temperature: float) -> torch.Tensor:
        """log π_ref for the KL term: the frozen copy (full fine-tuning) or the adapter disabled (LoRA)."""
        if self.reference is not None:
            return completion_log_probs(self.reference, batch, temperature)
        with self.policy.disable_adapter():
            return completion_log_probs(self.policy_wrapped, batch, temperature)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.policy_wrapped.parameters() if p.requires_grad]

    # ------------------------------------------------------------------------------------------
    # metrics, evaluation
    # ------------------------------------------------------------------------------------------

    def step_metrics(
        self, rollouts: TripletRollouts, rewards, advantages, truncated, update, timings, step
    ) -> dict[str, float]:
        """A step's metrics. ``rewards``, ``advantages`` and ``truncated`` (the positives', (B, K))
        are the global batch's; the rollout and throughput numbers are this process's, which
        :meth:`_reduce` combines."""
        positives = rollouts.positives
        everything = [rollouts.queries, rollouts.negatives, positives]
        generated = float(sum(r.lengths.sum() for r in everything)) + sum(
            int((torch.tensor(r.stop_ids) >= 0).sum()) for r in everything if len(r)
        )
        # processes can hold different numbers of negatives: these ratios are of global sums
        rows = sum(len(r) for r in everything)
        negatives = rollouts.negatives
        rows_all, truncated_all, negative_count, negative_tokens = self._sum_over_processes(
            rows,
            sum(int(r.truncated.sum()) for r in everything),
            len(negatives),
            float(negatives.lengths.sum()) if len(negatives) else 0.0,
        )
        metrics: dict[str, float] = {f"reward/{name}": value.float().mean().item() for name, value in rewards.items()}
        metrics["reward/final_std_in_group"] = rewards["final"].std(dim=1, unbiased=False).mean().item()
        cfg = self.config
        parts = reward_parts(
            rewards,
            truncated,
            lambda_consistency=cfg.lambda_consistency,
            lambda_hard_negative=cfg.lambda_hard_negative,
            tau=cfg.tau,
            length_penalty_mode=cfg.length_penalty_mode,
        )
        metrics.update({f"advantage_share/{name}": value for name, value in advantage_shares(parts).items()})
        metrics.update(
            {
                "advantage/mean": advantages.mean().item(),
                "advantage/std": advantages.std(unbiased=False).item(),
                "advantage/abs_mean": advantages.abs().mean().item(),
                "advantage/min": advantages.min().item(),
                "advantage/max": advantages.max().item(),
                "rollout/positive_length_mean": positives.lengths.mean().item(),
                "rollout/positive_length_max": positives.lengths.max().item(),
                "rollout/query_length_mean": rollouts.queries.lengths.mean().item(),
                "rollout/negative_length_mean": negative_tokens / max(negative_count, 1.0),
                "rollout/prompt_length_mean": positives.prompt_lengths.mean().item(),
                "rollout/truncation_rate": positives.truncated.float().mean().item(),
                "rollout/truncation_rate_all": truncated_all / max(rows_all, 1.0),
                "rollout/count": float(rows),
                "loss": update["loss"],
                "loss/policy": update["policy_loss"],
                "loss/contrastive": update["contrastive_loss"],
                "grad_norm": update["grad_norm"],
                "clip_fraction": update["clip_fraction"],
                "kl": update["kl"],
                "lr": update["lr"],
                "epoch": (step + 1) / self.steps_per_epoch,
                "time/rollout_s": timings["rollout"],
                "time/reward_s": timings["reward"],
                "time/update_s": timings["update"],
                "time/step_s": timings["step"],
                "time/weight_sync_s": update["weight_sync_s"],  # into the vLLM engine (0 with hf)
                "time/rollout_share": timings["rollout"] / max(timings["step"], 1e-9),
                "throughput/generated_tokens": generated,
                "throughput/generated_tokens_per_s": generated / max(timings["rollout"], 1e-9),
                "throughput/tokens_per_s": (generated + update["update_tokens"]) / max(timings["step"], 1e-9),
            }
        )
        return metrics

    def _reduce(self, metrics: dict[str, float]) -> dict[str, float]:
        """Combine each process's metrics into the global batch's (a no-op on one process).

        Counts, losses (already divided by the global token count) and throughputs add up;
        maxima and times take the slowest or largest; the rest are means, exact because every
        process holds as many instances and positive rollouts (ratios over negatives, whose
        numbers differ, are computed from global sums in :meth:`step_metrics`).
        """
        if self.accelerator.num_processes == 1:
            return metrics
        keys = list(metrics)
        values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.accelerator.device)
        everywhere = self._gather(values[None]).cpu()  # (processes, keys)
        combined = {}
        for column, key in enumerate(keys):
            how = _REDUCTIONS.get(key) or ("max" if key.startswith("time/") else "mean")
            combined[key] = float(getattr(everywhere[:, column], how)())
        return combined

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` from every process, concatenated in process order (itself on one process)."""
        world = self.accelerator.num_processes
        if world == 1:
            return tensor
        if tensor.numel() == 0:  # (B, 0, …) negatives: NCCL's gather cannot reshape an empty result
            return tensor.new_zeros((tensor.shape[0] * world, *tensor.shape[1:]))
        flag = tensor.dtype == torch.bool  # gloo has no bool all-gather
        gathered = self.accelerator.gather((tensor.to(torch.uint8) if flag else tensor).to(self.accelerator.device))
        return (gathered.bool() if flag else gathered).to(tensor.device)

    def _sum_over_processes(self, *values: float) -> list[float]:
        """Each value summed over processes (one gather for all of them)."""
        local = torch.tensor([values], dtype=torch.float64)
        return self._gather(local).sum(0).tolist()

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

        path = write_checkpoint(
            cfg.output_dir,
            self.step,
            write_model=lambda target: save_model_dir(self.st_model, target, full_state),
            write_extra=card,
            trainer_state=state,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            accelerator=self.accelerator,
        )
        if self.accelerator.is_main_process:
            if self.pusher is not None and (final or not cfg.push_steps or self.step % cfg.push_steps == 0):
                self.pusher.submit(path, self.step)
            protected = self.pusher.pending_paths() if self.pusher is not None else set()
            rotate_checkpoints(cfg.output_dir, cfg.save_total_limit, protected)
        return path

    def resume(self, checkpoint: str | Path | None = None) -> int:
        """Restore weights, optimizer, scheduler, RNG and data position; returns the step.

        Without ``checkpoint``: the newest checkpoint in ``output_dir`` that loads. Each one that
        does not is logged with its reason and renamed ``corrupt-checkpoint-*`` (kept, but out of
        keep-last-k's count); none loadable raises :class:`CheckpointError` listing them. A
        ``checkpoint`` named explicitly is loaded or refused, never swapped for another.
        """
        if checkpoint:
            path = Path(checkpoint)
            state = self._load_checkpoint(path)
        else:
            path, state = self._load_newest_loadable()
            if path is None:
                logger.warning("--resume: no checkpoint in %s, starting from step 0", self.config.output_dir)
                return 0
        self.step = int(state["step"])
        self.last_metrics = state.get("metrics") or {}
        self.last_scores = state.get("scores") or {}
        if self.engine is not None:
            self.engine.sync_from(self.policy)
        logger.info("resumed from %s at step %d", path, self.step)
        return self.step

    def _load_checkpoint(self, path: Path) -> dict[str, Any]:
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

    def _load_newest_loadable(self) -> tuple[Path | None, dict[str, Any] | None]:
        output_dir = self.config.output_dir
        candidates = [path for _, path in reversed(list_checkpoints(output_dir))]
        if not candidates:
            return None, None
        skipped: list[tuple[Path, CheckpointError]] = []
        for path in candidates:
            try:
                state = self._load_checkpoint(path)
            except CheckpointError as error:
                logger.warning("--resume: skipping %s: %s", path, error)
                skipped.append((path, error))
                continue
            if skipped:
                self._set_aside(skipped)
                logger.warning(
                    "--resume: took %s, the newest loadable checkpoint; skipped %s",
                    path,
                    ", ".join(p.name for p, _ in skipped),
                )
            return path, state
        reasons = "; ".join(str(error) for _, error in skipped)
        raise CheckpointError(f"--resume: no loadable checkpoint in {output_dir} ({reasons})")

    def _set_aside(self, skipped: list[tuple[Path, CheckpointError]]) -> None:
        self.accelerator.wait_for_everyone()  # no process may still be reading them
        if self.accelerator.is_main_process:
            for path, _ in skipped:
                target = set_aside_corrupt(path)
                logger.warning("--resume: renamed %s to %s (kept for a look, out of rotation)", path.name, target.name)
        self.accelerator.wait_for_everyone()

    # ------------------------------------------------------------------------------------------

    def _build_vllm_engine(self):
        from .vllm_backend import VLLMRolloutEngine

        cfg = self.config
        path = cfg.model_name_or_path
        if path is None or not Path(path).exists():
            path = str(Path(cfg.output_dir) / "initial-model")
            if self.accelerator.is_main_process:
                save_model_dir(self.st_model, Path(path))
            self.accelerator.wait_for_everyone()
        return VLLMRolloutEngine(
            self.encoder,
            path,
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
            tensor_parallel_size=cfg.vllm_tensor_parallel_size,
            max_model_len=cfg.max_prompt_tokens + cfg.max_response_tokens + 1,
            dtype="bfloat16" if cfg.bf16 else "auto",
            seed=cfg.seed,
            enable_sleep_mode=cfg.vllm_enable_sleep_mode,
        )


# How :meth:`GRPOTrainer._reduce` combines a metric over processes (default: mean; ``time/*``: max).
_REDUCTIONS = {
    **dict.fromkeys(
        [
            "loss",
            "loss/policy",
            "loss/contrastive",
            "clip_fraction",
            "kl",
            "rollout/count",
            "throughput/generated_tokens",
            "throughput/generated_tokens_per_s",
            "throughput/tokens_per_s",
        ],
        "sum",
    ),
    "rollout/positive_length_max": "max",
}


def add_lora_adapter(model, config: GRPOConfig):
    """The policy as a PEFT LoRA adapter on a frozen base (rank, alpha, targets from the config)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.lora_target_modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def lr_schedule(config: GRPOConfig, total_steps: int):
    """Multiplier of the learning rate at a step: constant (paper), or linear decay; optional warm-up."""

    def factor(step: int) -> float:
        if config.warmup_steps and step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.lr_scheduler == "linear":
            return max(0.0, 1.0 - step / max(total_steps, 1))
        return 1.0

    return factor


def _processes_without_a_gpu() -> bool:
    """Several processes (torchrun, ``accelerate launch --multi_gpu``) and no CUDA or XPU device:
    accelerate must be told ``cpu=True`` to join them over gloo instead of running each alone."""
    from accelerate.utils import is_xpu_available

    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return several and not torch.cuda.is_available() and not is_xpu_available()


def _check_sharding(accelerator, config: GRPOConfig) -> None:
    """Sharding that would not run what was asked for, refused before the model loads.

    - FSDP asked for (``accelerate launch`` with an FSDP config) but not set up: accelerate 1.x
      promotes a run to FSDP only from a GPU-type process group; on CPU it runs plain DDP over
      gloo, replicating the weights the user meant to shard.
    - FSDP with HF rollouts on several processes: every forward of a sharded model gathers its
      weights from all processes, and each process decodes its own rows until they end, so the
      processes would make different numbers of forwards and wait for each other forever.
    """
    from accelerate.utils import DistributedType

    wanted = os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")
    sharded = accelerator.distributed_type == DistributedType.FSDP
    if wanted and not sharded:
        raise LaunchError(
            f"an FSDP launch, but accelerate set up {accelerator.distributed_type.value} (FSDP needs CUDA GPUs "
            "under accelerate); on CPU launch with --multi_gpu instead (DDP over gloo)"
        )
    if sharded and accelerator.num_processes > 1 and config.rollout_backend == "hf":
        raise ConfigError(
            "rollout_backend: hf cannot run under FSDP on several processes (each process decodes its own "
            "rollouts, a different number of sharded forwards); use rollout_backend: vllm, or DDP",
            key="rollout_backend",
        )


def _cap_per_source(rows: list[Triplet], cap: int, seed: int) -> list[Triplet]:
    if not cap:
        return rows
    by_source: dict[str, list[Triplet]] = {}
    for row in rows:
        by_source.setdefault(row.source, []).append(row)
    out = []
    for items in by_source.values():
        out.extend(items if len(items) <= cap else random.Random(seed).sample(items, cap))
    return out


def _progress_bar(total: int, initial: int, disable: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=disable, desc="GRPO", unit="step", dynamic_ncols=True)
