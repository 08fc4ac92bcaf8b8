"""GRACE's training step (method.md §2): rollout → embed → reward → advantage → update, one optimiser step.

Read :meth:`GRPOStep.__call__` top to bottom; each stage is a method a test can call alone:

- :meth:`~GRPOStep.rollout`: Eq. 4 with embeddings by Eq. 3 (no gradient), through the engine ``encode``
  uses (:mod:`grace_training.algorithms.grpo.rollout`);
- :meth:`~GRPOStep.compute_rewards`: Eqs. 5–9, 13, 28;
- :func:`grace_training.algorithms.grpo.loss.group_advantages`: Eq. 10;
- :meth:`~GRPOStep.update`: Eq. 11, one optimiser step (or ``ppo_epochs`` clipped ones), plus
  β · the hybrid term on the same pass's pooled states when ``contrastive_beta`` > 0
  (:meth:`~GRPOStep.contrastive_term`; β = 0 is the paper's GRACE), plus ``text_kl_coef`` · KL to the
  reference over the text's positions.

Processes: the global batch is split evenly across processes; the in-batch terms (Eq. 7, the hybrid
InfoNCE) see every process's rollouts through a gather, and Eq. 11's token count is the global batch's.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass

import torch

from grace_training.algorithms.grpo.hybrid import (
    graded_pairs_loss,
    hybrid_candidates,
    hybrid_contrastive_loss,
    pooled_with_grad,
)
from grace_training.algorithms.grpo.loss import (
    build_policy_batch,
    completion_log_probs,
    group_advantages,
    grpo_loss,
    policy_pass,
    text_kl,
    text_log_probs,
)
from grace_training.algorithms.grpo.metrics import step_metrics
from grace_training.algorithms.grpo.rewards import compute_rewards
from grace_training.algorithms.grpo.rollout import TripletRollouts, asymmetric_rollouts, hf_generate
from grace_training.algorithms.grpo.rollout_batch import RolloutBatch
from grace_training.algorithms.grpo.vllm_backend import build_rollout_engine
from grace_training.data.examples import Triplet
from grace_training.run.processes import gather, reduce_metrics, sum_over_processes
from grace_training.steps import StepContext, StepResult, TrainingStep


@dataclass(frozen=True)
class ChunkInputs:
    """One chunk of the positive rollouts and what its loss is held to, fixed before the update's passes: the
    chunk's rows, their advantages (Eq. 10), log π_old (``ppo_epochs`` > 1) and log π_ref (``kl_coef`` > 0) over
    their completions, and the reference's log-probabilities over their text (``text_kl_coef`` > 0)."""

    rows: list[int]
    advantages: torch.Tensor
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    ref_text: torch.Tensor | None = None


@dataclass(frozen=True)
class UpdateContext:
    """What every chunk's loss shares in a step: Eq. 11's token count T and the text KL's position count over the
    global batch, the hybrid term's candidates (every chunk's positives; None without the term) and the gold scores of
    a batch of scored pairs (else None)."""

    num_tokens: float
    num_text: float = 0.0
    candidates: tuple[torch.Tensor, ...] | None = None
    scores: torch.Tensor | None = None


class GRPOStep(TrainingStep):
    def __init__(self, context: StepContext) -> None:
        super().__init__(context)
        # the rollout backend: the HF one-pass rollout through the engine encode uses, or a vLLM engine
        config = self.config
        self.engine = None
        self.generate = functools.partial(
            hf_generate, self.encoder, batch_size=config.rollout_batch_size, bucket_ratio=config.rollout_bucket_ratio
        )
        if config.rollout_backend == "vllm":
            self.engine = build_rollout_engine(self.encoder, context.st_model, config, self.accelerator)
            self.generate = self.engine.generate

    @classmethod
    def needs_reference(cls, config) -> bool:
        return config.kl_coef > 0 or config.text_kl_coef > 0

    def after_resume(self) -> None:
        if self.engine is not None:
            self.engine.sync_from(self.policy)

    def __call__(self, batch: list[Triplet], step: int) -> StepResult:
        """One GRPO step: Eq. 4 rollouts, Eqs. 5–9/13/28 rewards, Eq. 10 advantages, Eq. 11 update."""
        start, cpu_start = time.perf_counter(), time.process_time()
        scores = self.context.graded_scores(step)
        rollouts = self.rollout(batch, step, graded=scores is not None)
        rolled = time.perf_counter()
        rewards = self.compute_rewards(rollouts)
        advantages = group_advantages(rewards["final"], self.config.scale_rewards)
        rewarded = time.perf_counter()
        update = self.update(rollouts, advantages.reshape(-1), scores)
        updated = time.perf_counter()
        example = {
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
            rollouts,
            rewards,
            gather(self.accelerator, advantages),
            truncated,
            update,
            timings,
            config=self.config,
            epoch=(step + 1) / self.context.steps_per_epoch,
            accelerator=self.accelerator,
        )
        return StepResult(reduce_metrics(self.accelerator, metrics), example)

    def rollout(self, batch: list[Triplet], step: int, graded: bool | None = None) -> TripletRollouts:
        """Eq. 4 (one rationale per query and negative, K per positive), embeddings by Eq. 3; one greedy
        rationale a text in a warm-start step or a step of scored pairs (``graded``; None: asks the run)."""
        cfg = self.config
        if graded is None:
            graded = self.context.graded_scores(step) is not None
        self.policy.eval()
        with self.accelerator.autocast():
            return asymmetric_rollouts(
                self.encoder,
                batch,
                step=step,
                generate=self.generate,
                instance_offset=self.accelerator.process_index * self.context.local_batch_size,
                **cfg.rollout_settings(step, graded=graded),
            )

    def compute_rewards(self, rollouts: TripletRollouts) -> dict[str, torch.Tensor]:
        """Eqs. 5–9 (or 13 unsupervised) and 28 for every positive rollout, each (B, K)."""
        cfg = self.config
        query, positives, negatives, mask, truncated = rollouts.grouped(cfg.num_negatives)
        all_queries, all_positives, own = query, positives, None
        if self.accelerator.num_processes > 1:
            all_queries, all_positives = gather(self.accelerator, query), gather(self.accelerator, positives)
            own = torch.arange(len(query)) + self.accelerator.process_index * self.context.local_batch_size
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
        and adds β · InfoNCE (:mod:`grace_training.algorithms.grpo.hybrid`). Queries and negatives are the
        rollouts' embeddings (``contrastive_anchors: detached``) or recomputed with gradient
        (``recompute``). Within a chunk, the positives of other chunks act as in-batch negatives
        through their rollout embeddings (no gradient); one chunk is exact. A batch of scored pairs
        (``scores``) takes β · CoSENT instead (:func:`grace_training.algorithms.grpo.hybrid.graded_pairs_loss`).
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
        ref_text, num_text = self.text_references(batches)
        inputs = [
            ChunkInputs(rows, advantages[rows], old_log_probs[i], ref_log_probs[i], ref_text[i])
            for i, rows in enumerate(chunks)
        ]
        shared = UpdateContext(num_tokens, num_text, candidates, scores)
        totals = dict.fromkeys(("loss", "clip_fraction", "kl", "text_kl", "policy_loss", "contrastive_loss"), 0.0)
        seconds = dict.fromkeys(("forward", "backward", "optimizer"), 0.0)  # the step profile's parts
        grad_norm = torch.tensor(0.0)
        for _ in range(cfg.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for i, (batch, chunk) in enumerate(zip(batches, inputs)):
                terms = self._accumulate(i == len(batches) - 1, seconds, rollouts, batch, chunk, shared)
                share = batch["completion_mask"].sum().item() / max(num_tokens, 1.0)
                for name, value in terms.items():
                    totals[name] += value * (share if name in ("clip_fraction", "kl") else 1.0) / cfg.ppo_epochs
            started = time.perf_counter()
            grad_norm = self.optimizer_step()
            seconds["optimizer"] += time.perf_counter() - started
        self.scheduler.step()
        self.policy_wrapped.eval()
        update_tokens = float(sum(b["attention_mask"].sum() for b in batches))
        sizes = {"lr": lr, "grad_norm": float(grad_norm), "trained_tokens": num_tokens, "update_tokens": update_tokens}
        return {**totals, **sizes, "weight_sync_s": self.sync_rollout_engine(), "seconds": seconds}

    def text_references(self, batches: list[dict[str, torch.Tensor]]) -> tuple[list, float]:
        """With ``text_kl_coef`` > 0: the reference's log-probabilities over each chunk's text positions and
        the global batch's count of them; else nothing to hold the text to."""
        if self.config.text_kl_coef <= 0:
            return [None] * len(batches), 0.0
        references = self.reference_text_log_probs(batches)
        (num_text,) = sum_over_processes(
            self.accelerator, float(sum(b["text_mask"][b["text_rows"]].sum() for b in batches))
        )
        return references, num_text

    def _accumulate(
        self, last: bool, seconds: dict[str, float], rollouts, batch, chunk: ChunkInputs, shared: UpdateContext
    ) -> dict[str, float]:
        """One chunk's loss (:meth:`chunk_loss`) backpropagated, its forward and backward seconds added to
        ``seconds``; the gradients are synchronised over processes at the last chunk only."""
        accelerator = self.accelerator
        sync = contextlib.nullcontext() if last else accelerator.no_sync(self.policy_wrapped)
        with sync, accelerator.autocast():
            started = time.perf_counter()
            loss, terms = self.chunk_loss(rollouts, batch, chunk, shared)
            forwarded = time.perf_counter()
            # DDP and FSDP average gradients over processes: scaled by their number, that
            # average is the gradient of one process holding the whole batch.
            accelerator.backward(loss * accelerator.num_processes)
            seconds["forward"] += forwarded - started
            seconds["backward"] += time.perf_counter() - forwarded
        return terms

    def policy_batches(self, positives: RolloutBatch) -> tuple[list[list[int]], list[dict[str, torch.Tensor]]]:
        """The positive rollouts as ``gradient_accumulation_steps`` chunks of rows and their
        policy batches (:func:`~grace_training.algorithms.grpo.loss.build_policy_batch`), on the device.

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
        self, rollouts, batch, chunk: ChunkInputs, shared: UpdateContext
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """One chunk's loss with gradient: Eq. 11 (:func:`~grace_training.algorithms.grpo.loss.grpo_loss`), plus
        β · the hybrid term over the same pass's pooled states (CoSENT for a batch of scored pairs),
        plus ``text_kl_coef`` · KL to the reference over the text's positions
        (:func:`~grace_training.algorithms.grpo.loss.text_kl`); and its parts as numbers."""
        cfg = self.config
        hybrid = cfg.contrastive_beta > 0
        temperature = rollouts.positives.temperature
        log_probs, pooled, text_logits = policy_pass(
            self.policy_wrapped,
            batch,
            temperature,
            pool_from=self.policy if hybrid else None,
            hidden_layer=self.encoder.hidden_layer,
            text=chunk.ref_text is not None,
        )
        old = chunk.old_log_probs if chunk.old_log_probs is not None else log_probs.detach()
        loss, stats = grpo_loss(
            log_probs,
            old,
            chunk.advantages,
            batch["completion_mask"],
            clip_epsilon=cfg.clip_epsilon,
            ref_log_probs=chunk.ref_log_probs,
            kl_coef=cfg.kl_coef,
            num_tokens=shared.num_tokens,
        )
        policy_loss = loss.detach()
        contrastive = torch.zeros((), device=self.accelerator.device)
        if hybrid:
            contrastive = self.contrastive_term(rollouts, chunk.rows, pooled, shared.candidates, shared.scores)
            loss = loss + cfg.contrastive_beta * contrastive
        held = torch.zeros((), device=self.accelerator.device)
        if chunk.ref_text is not None:
            held = text_kl(text_logits, chunk.ref_text, batch["text_mask"][batch["text_rows"]], shared.num_text)
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

    def contrastive_term(self, rollouts, chunk, pooled, candidates, scores) -> torch.Tensor:
        """The hybrid term over the chunk's pooled states (:mod:`grace_training.algorithms.grpo.hybrid`): CoSENT for a batch of
        scored pairs, else InfoNCE against the rollouts' queries and negatives (recomputed with gradient
        unless ``contrastive_anchors: detached``), normalised by the global batch's positives."""
        cfg, accelerator = self.config, self.accelerator
        if scores is not None:
            return graded_pairs_loss(candidates, rollouts, chunk, pooled, scores, cfg, accelerator.process_index)

        def recompute() -> torch.Tensor:
            anchors = (rollouts.queries, rollouts.negatives)
            encoder = self.encoder
            return pooled_with_grad(
                self.policy_wrapped,
                self.policy,
                anchors,
                encoder.engine.view,
                accelerator.device,
                prompts_only=cfg.contrastive_anchors == "recompute_prompts",
            )

        recomputed = recompute if cfg.contrastive_anchors != "detached" else None
        return hybrid_contrastive_loss(
            candidates, rollouts, chunk, pooled, cfg, accelerator.process_index, recomputed
        ) / (len(rollouts.positives) * accelerator.num_processes)

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
        if self.context.reference is not None:
            return completion_log_probs(self.context.reference, batch, temperature)
        with self.policy.disable_adapter():
            return completion_log_probs(self.policy_wrapped, batch, temperature)

    def reference_text_log_probs(self, batches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Per chunk, the reference's next-token log-probabilities over the prompts' positions, for
        ``text_kl_coef``: the frozen copy (full fine-tuning) or the adapter disabled (LoRA)."""
        with torch.no_grad(), self.accelerator.autocast():
            if self.context.reference is not None:
                return [text_log_probs(self.context.reference, batch) for batch in batches]
            with self.policy.disable_adapter():
                return [text_log_probs(self.policy_wrapped, batch) for batch in batches]
