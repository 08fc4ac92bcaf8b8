"""The InfoNCE baseline (the paper's "w/ CL" row): the same causal LM, the same data, trained
with sentence-transformers' own trainer and ``MultipleNegativesRankingLoss`` (``CoSENTLoss`` on a graded
source's scored pairs, as GRPO's graded term).

InfoNCE needs a gradient through the embedding, and a sampled rationale has none, so the
baseline trains the embedding of the prompt alone: Eq. 3's pooling over ``P(x)`` (positions
t > L_sys, the "Base" row of the paper), with the encoder's own template and instructions
(queries with ``query_task``, documents with ``document_task``). The result is saved as a
GRACE model with the input model's encoder settings and a rationale budget of 0, so it encodes
as it was trained and is evaluated like every other checkpoint (``@32`` in ``dev_eval.py``
scores it with a rationale it never saw).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch
from torch import Tensor

from grace_st import GenerativeEncoder
from grace_st.runtime.transformers_compat import activation_checkpointing_argument
from grace_training.config.train_config import TrainConfig
from grace_training.data.examples import Triplet, load_data, source_weights
from grace_training.data.sampling import BatchSchedule
from grace_training.policy import card_base_model, load_grace_model
from grace_training.run.checkpoint import CheckpointError
from grace_training.run.metrics import MetricsLogger

logger = logging.getLogger(__name__)


class PromptPoolingEncoder(GenerativeEncoder):
    """A GenerativeEncoder whose forward keeps the gradient: one pass over the left-padded
    prompt, Eq. 3 pooling over t > L_sys, no rationale. Training-only; never saved."""

    def forward(self, features: dict[str, Tensor], task: str | None = None, **kwargs) -> dict[str, Tensor]:
        pooled, states = self.engine.embed_prompts(
            features["input_ids"], features["attention_mask"], features["instruction_lengths"]
        )
        return {**features, "token_embeddings": states, "sentence_embedding": pooled.to(states.dtype)}


def infonce_dataset(rows: list[Triplet]):
    """(anchor, positive[, negative]) columns; the negative column only when every row has one. Scored pairs
    (a graded source): (anchor, positive, score), which sentence-transformers reads as the label."""
    from datasets import Dataset

    columns = {"anchor": [r.query for r in rows], "positive": [r.positive for r in rows]}
    if rows and all(r.score is not None for r in rows):
        columns["score"] = [float(r.score) for r in rows]
    elif rows and all(r.negatives for r in rows):
        columns["negative"] = [r.negatives[0] for r in rows]
    return Dataset.from_dict(columns)


def infonce_datasets(rows: list[Triplet], config: TrainConfig, batch_size: int):
    """The training set(s) and their router mapping (each column's prompt type).

    One dataset, queries and documents routed to ``query_task`` / ``document_task``, as the
    paper's baseline; or, when a source is ``symmetric`` or ``batch_sampling`` is ``by_source``,
    one dataset a source (sentence-transformers draws each batch from one of them, as GRPO's
    ``by_source`` does), symmetric sources routed to ``"default"``. Under ``by_source`` each
    source's dataset holds its share of the run's triplets by weight, drawn from the same
    per-source streams as GRPO's batches (:class:`~grace_training.data.sampling.BatchSchedule`).
    """
    from datasets import DatasetDict

    retrieval = {"anchor": config.query_task, "positive": config.document_task, "negative": config.document_task}
    if config.batch_sampling != "by_source" and any(r.score is not None for r in rows):
        raise ValueError("train_data: scored pairs (graded) need batch_sampling: by_source (a dataset of their own)")
    if config.batch_sampling != "by_source" and not any(r.symmetric for r in rows):
        return infonce_dataset(rows), retrieval
    weights = source_weights(config.train_data, rows, config.data_dir) if config.train_data else None
    schedule = BatchSchedule([r.source for r in rows], batch_size, config.seed, config.batch_sampling, weights)
    total = config.max_steps * batch_size if config.max_steps > 0 else len(rows) * max(config.epochs, 1)
    datasets, routes = {}, {}
    for name, members in schedule.members.items():
        if config.batch_sampling == "by_source":
            share = sum(schedule.weights[i] for i, n in enumerate(schedule.names) if n == name) / sum(schedule.weights)
            members = schedule.take(name, max(batch_size, round(total * share))) if share else []
        if not members:
            continue
        key = name.replace("/", "__")  # a dataset name, not a path
        datasets[key] = infonce_dataset([rows[i] for i in members])
        routes[key] = dict.fromkeys(retrieval, "default") if rows[members[0]].symmetric else retrieval
    return DatasetDict(datasets), routes


def step_cost_callback(metrics: MetricsLogger, max_minutes: float | None = None, stop_at_step: int | None = None):
    """A ``TrainerCallback`` that measures the baseline as GRPO is measured, so the two can be compared at
    equal CPU hours: each optimizer step's CPU seconds of this process (``time/step_cpu_s``, whatever else
    ran) with the step's loss, one line a step in ``metrics.jsonl``; and GRPO's ``--max-minutes``: the run
    stops (and is saved) at the first step that ends past that much wall time, or at ``stop_at_step``."""
    from transformers import TrainerCallback

    class StepCost(TrainerCallback):
        def __init__(self) -> None:
            self.pending: dict | None = None

        def flush(self) -> None:
            if self.pending is not None:
                metrics.log(self.pending.pop("step"), self.pending)
                self.pending = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
            self.cpu = time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            self.flush()  # a step the trainer did not log (logging_steps > 1)
            now = time.process_time()
            self.pending, self.cpu = {"step": state.global_step, "time/step_cpu_s": now - self.cpu}, now
            if state.global_step >= state.max_steps:
                control.should_save = False  # the Trainer's save at the last step: `final` holds the result
            elif (self.deadline is not None and time.monotonic() > self.deadline) or (
                stop_at_step is not None and state.global_step >= stop_at_step
            ):
                control.should_training_stop = True
                control.should_save = True  # the next chunk resumes from this step

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.pending is not None and self.pending["step"] == state.global_step:
                self.pending.update(
                    {k: v for k, v in (logs or {}).items() if k in ("loss", "grad_norm", "learning_rate")}
                )
                self.flush()

        def on_train_end(self, args, state, control, **kwargs):
            self.flush()

    return StepCost()


def last_trainer_checkpoint(output_dir: str | Path) -> tuple[Path, int] | None:
    """The baseline's newest complete checkpoint (``<output_dir>/trainer/checkpoint-<step>``) and its step.

    The Trainer writes ``trainer_state.json`` last, so a directory without it is a save a kill cut short
    and is passed over, as GRPO's resume passes over an incomplete checkpoint."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    found = [
        _trainer_checkpoint(path)
        for path in (Path(output_dir) / "trainer").glob(f"{PREFIX_CHECKPOINT_DIR}-*")
        if (path / "trainer_state.json").is_file()
    ]
    return max(found, key=lambda found: found[1]) if found else None


def resume_checkpoint(output_dir: str | Path, resume: bool | str) -> tuple[Path, int] | None:
    """What ``resume`` names: ``False`` nothing, ``True`` the newest complete checkpoint of ``output_dir``,
    a path that checkpoint; :class:`CheckpointError` when there is none to go on from."""
    if isinstance(resume, str):
        return _trainer_checkpoint(Path(resume))
    if not resume:
        return None
    checkpoint = last_trainer_checkpoint(output_dir)
    if checkpoint is None:
        raise CheckpointError(
            f"--resume: {Path(output_dir) / 'trainer'} holds no complete InfoNCE checkpoint to go on from"
        )
    return checkpoint


def _trainer_checkpoint(path: Path) -> tuple[Path, int]:
    """A Trainer checkpoint directory and its step, or :class:`CheckpointError` naming what is missing."""
    state = path / "trainer_state.json"
    try:
        return path, int(json.loads(state.read_text(encoding="utf-8"))["global_step"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{state}: not a complete InfoNCE checkpoint ({error})") from error


def train_infonce(
    config: TrainConfig,
    *,
    model=None,
    train_data: list[Triplet] | None = None,
    max_minutes: float | None = None,
    resume: bool | str = False,
    stop_at_step: int | None = None,
) -> Path:
    """Fine-tune with MNRL on ``config.train_data``; returns ``<output_dir>/final`` (a GRACE model directory).

    ``max_minutes``: stop at the first step past that wall time (:func:`step_cost_callback`), with a
    checkpoint there; ``stop_at_step``: stop at that step, with a checkpoint (``final`` holds the model where a run
    stops, whichever way). ``resume``: go on from the newest checkpoint under ``<output_dir>/trainer``, or from
    the checkpoint directory given (sentence-transformers' Trainer restores the weights, AdamW's moments, the RNG
    states and the data position: the run goes on as if it had not stopped), so the yardstick can run for as many
    CPU hours as a GRACE run, one chunk at a time. The Trainer's optimizer and RNG files are ``torch.save``
    files; it reads them back with ``weights_only=True`` (tensors and plain containers, no code)."""
    from sentence_transformers import SentenceTransformerTrainingArguments

    if model is None:
        model = load_grace_model(config, "cuda" if torch.cuda.is_available() else "cpu")
    encoder = model[0]
    if train_data is None:
        train_data, _ = load_data(config.train_data, **config.data_settings())
    st = _prompt_pooling_model(model, config)
    output = Path(config.output_dir)
    arguments = _trainer_arguments(config, output)
    dataset, arguments["router_mapping"] = infonce_datasets(
        train_data, config, arguments["per_device_train_batch_size"]
    )
    loss = _infonce_loss(st, dataset, config)
    known = {f.name for f in dataclasses.fields(SentenceTransformerTrainingArguments)}
    args = SentenceTransformerTrainingArguments(**{k: v for k, v in arguments.items() if k in known})
    checkpoint = resume_checkpoint(output, resume)
    if checkpoint and stop_at_step is not None and checkpoint[1] >= stop_at_step:
        logger.info("InfoNCE baseline: the checkpoint at step %d is already at --stop-at-step", checkpoint[1])
        return output / "final"
    steps = _run_trainer(st, args, dataset, loss, config, checkpoint, max_minutes, stop_at_step)

    encoder.model.eval()
    encoder.max_input_tokens = config.max_input_tokens
    # saved to encode as it was trained, from the prompt alone: a rationale it never saw costs it 0.08 on the
    # dev scoreboard's mean (decisions/D023)
    encoder.max_rationale_tokens = 0
    final = _save_final(model, config, output, args.per_device_train_batch_size, steps)
    logger.info("InfoNCE baseline: %d steps, saved to %s", steps, final)
    return final


def _prompt_pooling_model(model, config: TrainConfig):
    """The SentenceTransformer InfoNCE trains: a :class:`PromptPoolingEncoder` with the settings of ``model``'s
    encoder over the very LM object of it (training it trains the model that is saved), then normalisation."""
    from sentence_transformers import SentenceTransformer

    try:
        from sentence_transformers.base.modules import Normalize
    except ImportError:  # sentence-transformers 5.x
        from sentence_transformers.models import Normalize

    encoder = model[0]
    settings = {key: getattr(encoder, key) for key in ("instructions", "hidden_layer")}
    trainable = PromptPoolingEncoder(
        model=encoder.model,
        tokenizer=encoder.tokenizer,
        max_rationale_tokens=0,
        max_input_tokens=config.max_input_tokens,
        **settings,
    )
    return SentenceTransformer(modules=[trainable, Normalize()], device=str(next(encoder.model.parameters()).device))


def _infonce_loss(st, dataset, config: TrainConfig):
    """MNRL at the configured temperature; with one dataset a source (a ``DatasetDict``), a loss by dataset: CoSENT
    for the graded ones (a ``score`` column), MNRL for the rest."""
    try:
        from sentence_transformers.sentence_transformer.losses import CoSENTLoss, MultipleNegativesRankingLoss
    except ImportError:  # sentence-transformers 5.x
        from sentence_transformers.losses import CoSENTLoss, MultipleNegativesRankingLoss

    infonce = MultipleNegativesRankingLoss(st, scale=1.0 / config.infonce_temperature)
    if not hasattr(dataset, "items"):
        return infonce
    graded = CoSENTLoss(st, scale=config.graded_scale)
    return {name: graded if "score" in part.column_names else infonce for name, part in dataset.items()}


def _run_trainer(
    st,
    args,
    dataset,
    loss,
    config: TrainConfig,
    checkpoint: tuple[Path, int] | None,
    max_minutes: float | None,
    stop_at_step: int | None,
) -> int:
    """Run sentence-transformers' Trainer (from ``checkpoint`` when there is one), each step's cost in
    ``metrics.jsonl``; returns the step it stopped at."""
    from sentence_transformers import SentenceTransformerTrainer

    metrics = MetricsLogger(
        Path(config.output_dir),
        config.report_to,
        enabled=int(os.environ.get("RANK", "0")) == 0,
        resume_step=checkpoint[1] if checkpoint else None,
    )
    trainer = SentenceTransformerTrainer(
        model=st,
        args=args,
        train_dataset=dataset,
        loss=loss,
        callbacks=[step_cost_callback(metrics, max_minutes, stop_at_step)],
    )
    if checkpoint:
        logger.info("InfoNCE baseline: resuming from %s (step %d)", checkpoint[0], checkpoint[1])
    trainer.train(resume_from_checkpoint=str(checkpoint[0]) if checkpoint else None)
    metrics.close()
    return trainer.state.global_step


def _trainer_arguments(config: TrainConfig, output: Path) -> dict:
    """sentence-transformers training arguments for the baseline: a constant rate, and the Trainer's own
    checkpoints every ``save_steps`` (0: only where ``--max-minutes`` stops it), the last
    ``save_total_limit`` kept."""
    arguments = {
        "output_dir": str(output / "trainer"),
        "num_train_epochs": config.epochs,
        "max_steps": config.max_steps,
        "per_device_train_batch_size": config.infonce_batch_size or config.batch_size,
        "learning_rate": config.infonce_learning_rate,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": config.weight_decay,
        "max_grad_norm": config.max_grad_norm,
        "seed": config.seed,
        "bf16": config.bf16,
        "dataloader_pin_memory": torch.cuda.is_available(),
        "save_strategy": "steps",
        "save_steps": config.save_steps or 10**9,
        "save_total_limit": config.save_total_limit,
        "logging_steps": config.logging_steps,
        "report_to": [r for r in config.report_to if r == "tensorboard"] or "none",
        "dataloader_drop_last": True,
    }
    if config.gradient_checkpointing:
        arguments[activation_checkpointing_argument()] = True
    return arguments


def _save_final(model, config: TrainConfig, output: Path, batch_size: int, steps: int) -> Path:
    """``<output>/final``: the trained GRACE model and its card, written to a staging directory first."""
    from grace_st.model_cards import write_model_card

    final, staging = output / "final", output / ".tmp-final"
    shutil.rmtree(staging, ignore_errors=True)
    model.save(str(staging), create_model_card=False)
    write_model_card(
        model,
        staging,
        model_id=config.hub_model_id or f"{output.name}-infonce",
        base_model=card_base_model(config),
        training_config={
            "objective": "InfoNCE (MultipleNegativesRankingLoss), prompt pooling",
            "learning_rate": config.infonce_learning_rate,
            "batch_size": batch_size,
            "temperature": config.infonce_temperature,
            "steps": steps,
        },
    )
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    return final
