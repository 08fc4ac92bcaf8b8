"""The training loop: one run of ``grace-train``, whatever the algorithm.

Read :meth:`Trainer.train` top to bottom: claim ``output_dir`` (a marker, only the run's own
checkpoints rotated; :mod:`.run_dir`), resume (the checkpoint's config compared with the one given),
then for each step take the step's B triplets (:meth:`~Trainer.batch_for_step`: a function of the
step number, so a resumed run sees the batches a straight run would), run the algorithm's step, log,
evaluate, checkpoint (:meth:`~Trainer.save_checkpoint`, pushed to the Hub when asked), and stop at
the last step, at ``--stop-at-step`` or when a chunk's time is up.

What a step does is the algorithm's (:mod:`.steps`; its record in :mod:`.algorithms.registry`): GRACE's GRPO with
its hybrid term, GIRCSE's ICR, or GRC's Eq. 5 (the fourth algorithm, the InfoNCE yardstick, trains through
sentence-transformers' trainer). The loop owns what every algorithm shares: the data order, the policy (with its LoRA
adapter and KL reference), the optimiser and schedule, the checkpoints and the metrics; it asks the algorithm's step
class what it adds (its hooks: the encoder's preparation, a frozen reference, parameters beside the policy's).

Processes: ``accelerate`` runs it as one process, several CPU processes over gloo (DDP, tested
equal to one process), or several GPUs (DDP or FSDP2); see docs/training.md. The global batch is
split evenly across processes.
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from grace_st.runtime.transformers_compat import enable_activation_checkpointing
from grace_training.algorithms.registry import ALGORITHMS
from grace_training.config.train_config import (
    ConfigError,
    TrainConfig,
    check_batches,
    check_environment,
    check_launch,
    embedding_loss_names,
)
from grace_training.data.examples import Triplet, cap_per_source, load_data, source_weights
from grace_training.data.sampling import BatchSchedule
from grace_training.evaluation import evaluate
from grace_training.policy import add_lora_adapter, card_base_model, load_grace_model
from grace_training.run.checkpoint import (
    RunFamily,
    check_checkpoint,
    load_checkpoint,
    load_newest_loadable,
    remove_incomplete,
    rotate_checkpoints,
    save_model_dir,
    write_checkpoint,
)
from grace_training.run.metrics import MetricsLogger
from grace_training.run.processes import check_sharding, processes_without_a_gpu, sum_over_processes
from grace_training.run.run_dir import (
    CONFIG_FILE,
    check_config_changes,
    claim_output_dir,
    config_changes,
    inspect_output_dir,
    read_family,
    record_config_changes,
    saved_config,
)
from grace_training.steps import StepContext, TrainingStep

logger = logging.getLogger(__name__)

# Settings the optimizer and the schedule hold in their state, restored from a checkpoint over the config's.
OPTIMIZER_KEYS = frozenset(
    ("learning_rate", "lr_scheduler", "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
     "max_steps", "epochs")
)


class Trainer:
    """The training loop over a GRACE SentenceTransformer's causal LM; each step is ``config.algorithm``'s (its
    record's step class, :mod:`grace_training.algorithms.registry`).

    Args:
        config: the run's settings (paper defaults).
        model: a GRACE SentenceTransformer (``grace_st.from_causal_lm`` or loaded); default:
            ``config.model_name_or_path``, or the embedded default model.
        train_data, eval_data: lists of :class:`~grace_training.data.examples.Triplet`; default: loaded
            from ``config.train_data`` / ``config.eval_data``.
        hub_api: a stand-in for ``huggingface_hub.HfApi`` (tests); default: the real one.
        overwrite_output_dir: start in a directory that holds an earlier run (deleting that run's
            files) or other files (kept); see :mod:`grace_training.run.run_dir`.
        allow_config_change: let a resumed run change keys that change what is trained; they are
            applied from the next step and recorded in ``config_changes.jsonl``.
    """

    def __init__(
        self,
        config: TrainConfig,
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
        self.record = ALGORITHMS[config.algorithm]
        self.step_class = loop_step(config.algorithm)
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

        self.algorithm = self.step_class(self._step_context())  # what a step does (and its rollout backend)

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
        self.encoder.method = config.method  # how the saved model thinks: what the algorithm trains
        self.encoder.prompt_format = config.prompt_format
        self.step_class.prepare_encoder(self.encoder, config)
        if config.instructions is not None:
            self.encoder.instructions = dict(config.instructions)
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
        """The frozen start model (full fine-tuning only), the optimizer and the schedule; the policy prepared
        by accelerate."""
        config = self.config
        # The start model, frozen, where the step reads it (a KL reference, GRC's `start` response targets). With
        # LoRA it is the adapter disabled (no second copy in memory).
        self.reference = None
        if self.step_class.needs_reference(config) and config.finetune == "full":
            self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        optimizer = build_optimizer(self.trained_parameters(), config)
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
        graded_ready = config.batch_sampling == "by_source" and (
            config.contrastive_beta > 0 or self.record.embedding_loss
        )
        if not graded_ready and any(row.score is not None for row in train_data):
            # a scored pair trained as a positive would pull a pair scored 0 together
            raise ValueError(
                "train_data: scored pairs (graded) train β · CoSENT on batches of their own: "
                f"they need batch_sampling: by_source and contrastive_beta > 0 (or algorithm: {embedding_loss_names()})"
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
            self.pusher = hub_pusher(cfg, self.hub_api)
        if self.step == 0 and self.eval_data:
            self.last_scores = self.evaluate()
            self.metrics.log(0, self.last_scores)
        progress = tqdm(total=self.total_steps, initial=self.step, disable=not main, desc=self.record.label or cfg.algorithm,
                        unit="step", dynamic_ncols=True)
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
                self.metrics.log(self.step, {**metrics, "batch/source": batch_source(batch)})
            if cfg.save_steps and self.step % cfg.save_steps == 0 and self.step < self.total_steps:
                self.save_checkpoint()
                saved_at = self.step
            if self.step >= stop or (deadline is not None and self.step < self.total_steps and self._past(deadline)):
                break
        progress.close()
        return self._finish(saved_at)

    def _claim_output_dir(self, resume: bool) -> RunFamily:
        """Take ``output_dir`` for this run (:func:`~grace_training.run.run_dir.claim_output_dir`): every
        process checks, so a refusal stops them all; the main one acts, the others read its marker."""
        settings = {
            "algorithm": self.config.algorithm,
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
            close_pusher(self.pusher, self.config.hub_final_wait_s)
        self.metrics.close()
        return {"step": self.step, "metrics": self.last_metrics, "scores": self.last_scores}

    def _past(self, deadline: float) -> bool:
        """Whether the chunk's time is up, as every process sees it (they stop at the same step)."""
        (late,) = sum_over_processes(self.accelerator, float(time.monotonic() >= deadline))
        return late > 0

    def training_step(self, batch: list[Triplet], step: int) -> dict[str, float]:
        """One step of the run's algorithm: its metrics, after one optimiser step (its example kept for the card)."""
        result = self.algorithm(batch, step)
        self.last_example = result.example
        return result.metrics

    def _step_context(self) -> StepContext:
        return StepContext(
            config=self.config,
            accelerator=self.accelerator,
            st_model=self.st_model,
            encoder=self.encoder,
            policy=self.policy,
            policy_wrapped=self.policy_wrapped,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            reference=self.reference,
            steps_per_epoch=self.steps_per_epoch,
            local_batch_size=self.local_batch_size,
            parameters=self.trainable_parameters(),
            graded_scores=self.graded_scores,
        )

    # ------------------------------------------------------------------------------------------
    # stages
    # ------------------------------------------------------------------------------------------

    def batch_for_step(self, step: int) -> list[Triplet]:
        """This process's share of the step's global batch (:class:`~grace_training.data.sampling.BatchSchedule`)."""
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

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimiser steps, as the wrapped policy holds it (gradient clipping reads these)."""
        return [p for p in self.policy_wrapped.parameters() if p.requires_grad] + self.step_class.extra_parameters(
            self.encoder
        )

    def trained_parameters(self) -> list[torch.nn.Parameter]:
        """The policy's trainable parameters (the adapter's alone with LoRA), and those the algorithm trains beside
        them (GRC's latent tokens)."""
        return [p for p in self.policy.parameters() if p.requires_grad] + self.step_class.extra_parameters(self.encoder)

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
        free raises :class:`~grace_training.run.run_dir.ConfigChangeError` (see ``config.RESUME_CHANGES``),
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
        self.algorithm.after_resume()
        logger.info("resumed from %s at step %d", path, self.step)
        return self.step

    def _apply_config_changes(self, path: Path, state: dict[str, Any]) -> None:
        """The config changed since the checkpoint (and passed :meth:`_check_config`): what the
        optimizer and the schedule restored is set to the config's, and each change is recorded."""
        changes = config_changes(saved_config(state, self.config.output_dir), self.config)
        if not changes:
            return
        if OPTIMIZER_KEYS & {change.key for change in changes}:
            apply_optimizer_settings(self.optimizer, self.scheduler, self.config)
        logger.warning("--resume: config changed since %s, from step %d: %s", path, self.step + 1,
                       "; ".join(map(str, changes)))
        if self.accelerator.is_main_process:
            record_config_changes(self.config.output_dir, self.step, path, changes)

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
        self.step_class.load_extra_state(path, self.encoder)
        if state.get("steps_per_epoch") not in (None, self.steps_per_epoch):
            logger.warning(
                "the data changed since the checkpoint (%s batches an epoch, now %s): the order differs",
                state["steps_per_epoch"],
                self.steps_per_epoch,
            )
        return state


def loop_step(algorithm: str) -> type[TrainingStep]:
    """The step class of an algorithm that trains in this loop; one that trains outside it is refused."""
    record = ALGORITHMS[algorithm]
    step_class = record.step_class()
    if step_class is None:
        raise ConfigError(
            f"algorithm: {algorithm} trains outside this loop ({record.summary}); grace-train runs it", key="algorithm"
        )
    return step_class


def batch_source(batch: list[Triplet]) -> str:
    """The source a step's batch came from (one under ``batch_sampling: by_source``; several joined by "+"):
    logged beside the step's times, which differ by source as its texts' lengths do."""
    return "+".join(sorted({row.source for row in batch}))


def build_optimizer(parameters: list[torch.nn.Parameter], config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over the trained parameters (:meth:`Trainer.trained_parameters`)."""
    return torch.optim.AdamW(
        parameters,
        lr=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_epsilon,
        weight_decay=config.weight_decay,
    )


def lr_schedule(config: TrainConfig, total_steps: int):
    """Multiplier of the learning rate at a step: constant (paper), or linear decay; optional warm-up."""

    def factor(step: int) -> float:
        if config.warmup_steps and step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.lr_scheduler == "linear":
            return max(0.0, 1.0 - step / max(total_steps, 1))
        return 1.0

    return factor


def apply_optimizer_settings(optimizer, scheduler, cfg: TrainConfig) -> None:
    """A loaded optimizer holds the checkpoint's rate, betas, eps and weight decay, and the
    schedule its base rate: set them to the config's, and the current rate to the (possibly
    new) schedule's value at this step, so the next update uses what the record says."""
    groups = optimizer.param_groups
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


def hub_pusher(cfg: TrainConfig, api=None):
    """The background pusher of checkpoints to ``hub_model_id`` (:class:`grace_training.run.hub.HubPusher`)."""
    from grace_training.run.hub import HubPusher

    return HubPusher(
        cfg.hub_model_id, cfg.output_dir, api=api, private=cfg.hub_private, initial_backoff=cfg.hub_retry_backoff_s
    )


def close_pusher(pusher, wait_s: float) -> None:
    """Wait ``wait_s`` for pushes in flight; say what was not pushed and where it is kept."""
    if pusher.close(timeout=wait_s):
        return
    if pusher.disabled:
        logger.error("Hub pushes were disabled (%s); %s lists what was not pushed", pusher.disabled, pusher.journal)
    else:
        logger.warning("Hub pushes still pending; %s keeps them for the next run", pusher.journal)


# The name of earlier releases, kept importable for one release.
GRPOTrainer = Trainer
