"""One dataclass with every training setting; its defaults are the paper's (method.md §2).

A YAML file holds the same keys (``training/configs/paper.yaml`` is the paper's run); the CLI
overrides any key with ``key=value``. Paper values that differ between the paper's text and
its reference code are noted where they are set.

Why one file of ~660 lines: each key's type, default and range rule sit together (``RULES`` beside
the dataclass), and the rules that tie keys together and what a resume may change (``RESUME_CHANGES``)
beside them, so a new key is added in one place.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grace_st.settings import per_prompt_type

from .sampling import SAMPLINGS
from .validation import NON_EMPTY, ConfigError, Rule, above, at_least, between, check_value, coerce, one_of, subset_of

REWARD_MODES = ("paper", "per_rollout")
OBJECTIVES = ("supervised", "unsupervised")
BACKENDS = ("hf", "vllm")
LENGTH_PENALTY_MODES = ("add", "replace", "off")
LENGTH_PENALTY_UNITS = ("scaled", "reward")
REWARD_SCALING = ("none", "group")
FINETUNE_MODES = ("full", "lora")
CONTRASTIVE_ANCHORS = ("detached", "recompute", "recompute_prompts")
BAD_ROWS = ("skip", "error")
LR_SCHEDULERS = ("constant", "linear")


@dataclass
class GRPOConfig:
    """GRACE GRPO training settings (Eqs. 4–11, 28; paper defaults).

    Data sources (``train_data`` / ``eval_data``) are dicts, one per source, e.g.
    ``{"type": "beir", "path": "scifact", "split": "train", "num_negatives": 1}``;
    see :func:`grace_training.data.load_source` for every type and option.
    """

    # -- model ------------------------------------------------------------------------------
    model_name_or_path: str | None = None  # None: the untrained embedded SmolLM2, default_model_path(trained=False)
    base_model: str | None = None  # Hub id named on model cards (default: model_name_or_path if a Hub id)
    query_task: str = "query"  # which of the encoder's instructions P(·) wraps queries in
    document_task: str = "document"  # ... positives and negatives; "default" for symmetric data
    # The encoder's max_input_tokens and max_rationale_tokens under the names of the paper's code
    # (the saved model encodes with them); YAML files keep these keys.
    max_prompt_tokens: int = 1024  # paper: prompt ≤ 1024 tokens
    # paper: rationale ≤ 2048 tokens in training. Or budgets by prompt type, as the encoder's
    # max_rationale_tokens takes them (e.g. {default: 32, query: 32, document: 0}): each side is
    # trained at the budget it is encoded with, and a retrieval source whose documents get 0 rolls
    # out its queries (rollout.py)
    max_response_tokens: int | dict[str, int] = 2048

    # -- data -------------------------------------------------------------------------------
    objective: str = "supervised"  # "unsupervised": raw text, Eqs. 12–13
    data_dir: str | None = None  # relative source paths resolve against it (e.g. ../shared/data)
    train_data: list[dict[str, Any]] = field(default_factory=list)
    eval_data: list[dict[str, Any]] = field(default_factory=list)
    num_negatives: int = 1  # negatives per triplet used in Eq. 5 (extra ones are dropped)
    # "shuffled": one permutation of all triplets an epoch; "by_source": each step's batch from one
    # source, drawn by the sources' ``weight`` (sampling.py)
    batch_sampling: str = "shuffled"
    bad_rows: str = "skip"  # "skip": report (file, line) and go on; "error": refuse before training

    # -- rollouts (Eq. 4) -------------------------------------------------------------------
    num_rollouts: int = 8  # K, rationales per positive
    temperature_positive: float = 1.0  # paper: K positive rollouts at 1.0
    temperature_query: float = 0.5  # reference code: queries and negatives at 0.5
    temperature_negative: float = 0.5
    top_p: float = 1.0
    rollout_backend: str = "hf"  # "vllm": an engine in this process (GPU), see vllm_backend.py
    rollout_batch_size: int = 64  # rows generated at once by the HF backend (memory bound)
    # HF backend: a chunk also closes where prompts grow past this ratio (rollout.length_buckets), so short
    # prompts are not padded to long ones; null (default): chunks of rollout_batch_size in length order only.
    # Measured slower at the shipped settings (docs/scale.md: more decode passes cost more than the padding)
    rollout_bucket_ratio: float | None = None
    vllm_gpu_memory_utilization: float = 0.5  # paper: vLLM at 50 % of the GPU
    vllm_tensor_parallel_size: int = 1
    vllm_enable_sleep_mode: bool = False

    # -- rewards (Eqs. 5–9, 13, 28) ---------------------------------------------------------
    reward_mode: str = "paper"  # "per_rollout": negatives act per rollout (method.md §2)
    lambda_consistency: float = 0.2  # λ1 (Eq. 8)
    lambda_hard_negative: float = 0.2  # λ2 (Eq. 8)
    tau: float = 10.0  # Eq. 9; the paper's text says 10, its reference code divides by 0.1
    gamma: float = 1.0  # Eq. 28 length penalty
    length_penalty_mode: str = "add"  # "add": R̂ − γ; "replace": a truncated rollout's reward is −γ; "off"
    # "scaled": γ is in the units of R̂ (paper); "reward": in the units of R_total (cosines), i.e. −γ/τ,
    # so the penalty keeps its size relative to the contrastive terms whatever τ is.
    length_penalty_units: str = "scaled"
    mask_truncated: bool = False  # drop rollouts cut at the limit from Eq. 11 (TRL's mask_truncated_completions)
    scale_rewards: str = "none"  # "group": divide Eq. 10's advantages by the group's std (GRPO); "none": Dr. GRPO / paper

    # -- hybrid objective (beyond the paper): β · InfoNCE on the pooled states of the update pass --
    contrastive_beta: float = 0.0  # β; 0 is the paper's GRACE exactly
    contrastive_temperature: float = 0.05
    # queries and negatives: the rollouts' embeddings ("detached"), recomputed with gradient ("recompute"),
    # or recomputed only where embedded from the prompt alone, budget 0 ("recompute_prompts": the
    # documents of a retrieval source under the shipped budgets, so their embedding is trained too)
    contrastive_anchors: str = "detached"
    # [scale] warm start: the first N steps roll out one greedy rationale a text (K = 1, every temperature 0),
    # so Eq. 11's advantage is zero and β · InfoNCE on the pooled states is all that trains, at about half a
    # step's cost; from step N + 1 on, the configured K and temperatures (the full hybrid). 0: no warm start
    warm_start_steps: int = 0
    # [scale] graded pairs: a step drawn from an "sts" source (pairs with every gold score, no threshold) rolls
    # out one greedy rationale a text, like a warm-start step, and trains β · CoSENT on the pooled cosines
    # against the gold scores instead of β · InfoNCE (a ranking of the batch's pairs by score; the scale λ)
    graded_scale: float = 20.0

    # -- what is trained ----------------------------------------------------------------------
    finetune: str = "full"  # "lora": a PEFT LoRA adapter on a frozen base (KL reference = adapter disabled)
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list[str] | str = "all-linear"

    # -- policy optimisation (Eqs. 10–11) ---------------------------------------------------
    learning_rate: float = 1e-6  # AdamW, constant, no warm-up
    lr_scheduler: str = "constant"  # or "linear" (decay to 0 over the run)
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    ppo_epochs: int = 1  # optimisation passes over one batch's rollouts; > 1 uses the clipped ratio
    clip_epsilon: float = 0.2
    kl_coef: float = 0.0  # > 0: KL to the initial model (k3 estimator), keeps a frozen copy
    gradient_accumulation_steps: int = 1  # the positive rollouts of a step are split in this many chunks
    # The update pass runs the prompt the K rollouts of a positive share once, its keys and values
    # expanded to the K rows (the same loss and gradients; off with gradient checkpointing, which drops the KV cache)
    share_prompt_pass: bool = True

    # -- loop -------------------------------------------------------------------------------
    batch_size: int = 64  # B triplets per step, over all processes
    epochs: int = 2
    max_steps: int = -1  # > 0 stops there (takes precedence over epochs)
    seed: int = 42
    bf16: bool = False  # mixed precision through accelerate (GPU)
    gradient_checkpointing: bool = False
    output_dir: str = "runs/grace"
    logging_steps: int = 1
    save_steps: int = 100
    save_total_limit: int | None = 3  # keep-last-k checkpoints
    eval_steps: int = 0  # 0: evaluate only before and after training (when eval_data is set)
    eval_max_examples: int = 200
    eval_batch_size: int = 16
    report_to: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])

    # -- hub --------------------------------------------------------------------------------
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hub_private: bool = True
    push_steps: int = 0  # 0: push every saved checkpoint; N: every checkpoint whose step is a multiple of N
    hub_retry_backoff_s: float = 5.0  # first wait after a failed push; doubles up to 5 minutes
    hub_final_wait_s: float = 600.0  # at the end, wait this long for pending pushes; the journal keeps the rest

    # -- InfoNCE baseline (contrastive.py; the paper's "w/ CL" row) ---------------------------
    infonce_learning_rate: float = 1e-5
    infonce_batch_size: int | None = None  # None: batch_size
    infonce_temperature: float = 0.05  # MultipleNegativesRankingLoss scale = 1 / temperature

    def __post_init__(self) -> None:
        self.validate()
        for item in dataclasses.fields(self):  # an int given for a float key is stored as the float
            value = getattr(self, item.name)
            if _hints()[item.name] is float and isinstance(value, int) and not isinstance(value, bool):
                setattr(self, item.name, float(value))

    def validate(self) -> None:
        """Raise :class:`ConfigError` (a ValueError) naming the first bad setting and its value.

        Every key is checked for its annotated type (an int key refuses 2.5 and true, a float key
        refuses NaN and inf, a non-Optional key refuses null), then for its range (``RULES``),
        then the rules that tie keys together. Construction, ``from_yaml`` and ``--dry-run`` run it;
        what needs the data or the machine is :func:`check_batches` / :func:`check_environment`.
        """
        hints = _hints()
        for item in dataclasses.fields(self):
            check_value(item.name, getattr(self, item.name), hints[item.name], RULES[item.name])
        for key in ("train_data", "eval_data"):
            for index, source in enumerate(getattr(self, key)):
                _check_source(f"{key}[{index}]", source)
        for holds, key, message in _combination_rules(self):
            if not holds:
                raise ConfigError(message, key=key)

    # -- (de)serialisation --------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GRPOConfig:
        hints = _hints()
        unknown = sorted(str(key) for key in values if key not in hints)
        if unknown:
            message = f"unknown config key(s): {', '.join(_with_suggestion(k) for k in unknown)}"
            raise ConfigError(message, key=unknown[0])
        return cls(**{key: coerce(value, hints[key]) for key, value in values.items()})

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> GRPOConfig:
        """Read a YAML file, then apply ``key=value`` overrides (values parsed as YAML).

        Every error is a :class:`ConfigError` that names the file (or the override) and the key.
        """
        values = read_yaml_mapping(path)
        changes = parse_overrides(overrides or [])
        try:
            return cls.from_dict({**values, **changes})
        except ConfigError as error:
            raise locate(error, path, overrides) from None

    def to_yaml(self, path: str | Path) -> None:
        import yaml

        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False), encoding="utf-8")

    def data_settings(self) -> dict[str, Any]:
        """The keyword arguments of :func:`grace_training.data.load_data` this config sets."""
        return {name: getattr(self, name) for name in ("bad_rows", "data_dir", "num_negatives", "seed")}

    def rollout_settings(self, step: int | None = None, graded: bool = False) -> dict[str, Any]:
        """The keyword arguments of :func:`grace_training.rollout.asymmetric_rollouts` this config sets (Eq. 4)
        at ``step`` (0-based): within the first ``warm_start_steps``, or for a batch of ``graded`` pairs, one
        greedy rollout a text."""
        names = ("num_rollouts", "num_negatives", "seed", "temperature_query", "temperature_negative",
                 "temperature_positive", "top_p", "query_task", "document_task")
        settings = {"max_new_tokens": self.max_response_tokens, **{name: getattr(self, name) for name in names}}
        if graded or (step is not None and step < self.warm_start_steps):
            settings.update(num_rollouts=1, temperature_query=0.0, temperature_negative=0.0, temperature_positive=0.0)
        return settings

    @property
    def longest_response(self) -> int:
        """The largest rationale budget of any prompt type (KV sizes, token estimates)."""
        budgets = self.max_response_tokens
        return max(budgets.values()) if isinstance(budgets, dict) else budgets

    def reward_settings(self) -> dict[str, Any]:
        """The keyword arguments of :func:`grace_training.rewards.compute_rewards` this config sets
        (Eqs. 5–9, 13, 28)."""
        names = ("objective", "lambda_consistency", "lambda_hard_negative", "tau", "gamma", "length_penalty_mode",
                 "length_penalty_units")
        return {"mode": self.reward_mode, **{name: getattr(self, name) for name in names}}

    def summary(self) -> dict[str, Any]:
        """The settings worth a line on a model card (flat, JSON-friendly)."""
        keys = [
            "objective",
            "reward_mode",
            "num_rollouts",
            "batch_size",
            "num_negatives",
            "lambda_consistency",
            "lambda_hard_negative",
            "tau",
            "gamma",
            "length_penalty_mode",
            "length_penalty_units",
            "mask_truncated",
            "scale_rewards",
            "contrastive_beta",
            "contrastive_temperature",
            "contrastive_anchors",
            "warm_start_steps",
            "finetune",
            "lora_r",
            "lora_alpha",
            "learning_rate",
            "max_prompt_tokens",
            "max_response_tokens",
            "temperature_positive",
            "temperature_query",
            "temperature_negative",
            "epochs",
            "max_steps",
            "seed",
        ]
        return {key: getattr(self, key) for key in keys}

    def __str__(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


# -- per-key rules -------------------------------------------------------------------------------
# Types come from the annotations; these are the ranges. Every key has an entry (a test holds
# RULES to the dataclass's fields), so a new key cannot skip validation by omission.

POSITIVE, NON_NEGATIVE, AT_LEAST_ONE = above(0), at_least(0), at_least(1)
PROBABILITY_OPEN_TOP = between(0, 1, high_open=True)
REPORTERS = ("jsonl", "tensorboard")
SEED_RANGE = between(0, 2**32 - 1)  # NumPy's seeding takes nothing outside [0, 2**32)


def _is_repo_id(value: str) -> bool:
    parts = value.split("/")
    return len(parts) <= 2 and all(parts) and not any(c.isspace() for c in value)


RULES: dict[str, tuple[Rule, ...]] = {
    "model_name_or_path": (NON_EMPTY,),
    "base_model": (NON_EMPTY,),
    "query_task": (NON_EMPTY,),
    "document_task": (NON_EMPTY,),
    "max_prompt_tokens": (AT_LEAST_ONE,),
    "max_response_tokens": (
        Rule(
            lambda v: v >= 1 if not isinstance(v, dict) else per_prompt_type(0)(v) and max(v.values()) >= 1,
            "be an integer >= 1, or a mapping of prompt type to an integer >= 0 with a 'default' entry and one >= 1"
            " (GRPO needs a rationale)",
        ),
    ),
    "objective": (one_of(OBJECTIVES),),
    "data_dir": (NON_EMPTY,),
    "train_data": (),  # each source is checked by _check_source; empty is refused where data is loaded
    "eval_data": (),
    "num_negatives": (NON_NEGATIVE,),
    "batch_sampling": (one_of(SAMPLINGS),),
    "bad_rows": (one_of(BAD_ROWS),),
    "num_rollouts": (AT_LEAST_ONE,),
    "temperature_positive": (NON_NEGATIVE,),  # 0 is greedy
    "temperature_query": (NON_NEGATIVE,),
    "temperature_negative": (NON_NEGATIVE,),
    "top_p": (between(0, 1, low_open=True),),
    "rollout_backend": (one_of(BACKENDS),),
    "rollout_batch_size": (AT_LEAST_ONE,),
    "rollout_bucket_ratio": (at_least(1),),
    "vllm_gpu_memory_utilization": (between(0, 1, low_open=True),),
    "vllm_tensor_parallel_size": (AT_LEAST_ONE,),
    "vllm_enable_sleep_mode": (),
    "reward_mode": (one_of(REWARD_MODES),),
    "lambda_consistency": (NON_NEGATIVE,),  # a negative weight would reward the opposite of Eq. 8
    "lambda_hard_negative": (NON_NEGATIVE,),
    "tau": (POSITIVE,),
    "gamma": (NON_NEGATIVE,),
    "length_penalty_mode": (one_of(LENGTH_PENALTY_MODES),),
    "length_penalty_units": (one_of(LENGTH_PENALTY_UNITS),),
    "mask_truncated": (),
    "scale_rewards": (one_of(REWARD_SCALING),),
    "contrastive_beta": (NON_NEGATIVE,),
    "contrastive_temperature": (POSITIVE,),
    "contrastive_anchors": (one_of(CONTRASTIVE_ANCHORS),),
    "warm_start_steps": (NON_NEGATIVE,),
    "graded_scale": (POSITIVE,),
    "finetune": (one_of(FINETUNE_MODES),),
    "lora_r": (AT_LEAST_ONE,),
    "lora_alpha": (POSITIVE,),
    "lora_dropout": (PROBABILITY_OPEN_TOP,),
    "lora_target_modules": (NON_EMPTY,),
    "learning_rate": (POSITIVE,),
    "lr_scheduler": (one_of(LR_SCHEDULERS),),
    "warmup_steps": (NON_NEGATIVE,),
    "weight_decay": (NON_NEGATIVE,),
    "adam_beta1": (PROBABILITY_OPEN_TOP,),  # AdamW refuses a beta of 1 or more
    "adam_beta2": (PROBABILITY_OPEN_TOP,),
    "adam_epsilon": (POSITIVE,),
    "max_grad_norm": (NON_NEGATIVE,),  # 0: no clipping
    "ppo_epochs": (AT_LEAST_ONE,),
    "clip_epsilon": (POSITIVE,),
    "kl_coef": (NON_NEGATIVE,),
    "gradient_accumulation_steps": (AT_LEAST_ONE,),
    "share_prompt_pass": (),
    "batch_size": (AT_LEAST_ONE,),
    "epochs": (NON_NEGATIVE,),  # 0 only with max_steps > 0 (a combination rule)
    "max_steps": (at_least(-1),),  # -1 or 0: run the epochs
    "seed": (SEED_RANGE,),
    "bf16": (),  # whether this machine can run it is check_environment's question
    "gradient_checkpointing": (),
    "output_dir": (NON_EMPTY,),
    "logging_steps": (AT_LEAST_ONE,),  # a step logs when step % logging_steps == 0
    "save_steps": (NON_NEGATIVE,),  # 0: only the final checkpoint; a negative one would save every step
    "save_total_limit": (AT_LEAST_ONE,),  # null keeps every checkpoint
    "eval_steps": (NON_NEGATIVE,),
    "eval_max_examples": (NON_NEGATIVE,),  # 0: no cap
    "eval_batch_size": (AT_LEAST_ONE,),
    "report_to": (subset_of(REPORTERS),),
    "push_to_hub": (),
    "hub_model_id": (Rule(_is_repo_id, "be 'name' or 'owner/name' without spaces"),),
    "hub_private": (),
    "push_steps": (NON_NEGATIVE,),
    "hub_retry_backoff_s": (POSITIVE,),  # 0 would retry a failing push in a busy loop
    "hub_final_wait_s": (NON_NEGATIVE,),
    "infonce_learning_rate": (POSITIVE,),
    "infonce_batch_size": (AT_LEAST_ONE,),
    "infonce_temperature": (POSITIVE,),
}


# -- what --resume may change ---------------------------------------------------------------------
# A resumed run goes on under the config it is given; each key changed since the checkpoint is one of
#   FREE     bookkeeping, the run's length, how (not what) it computes: changes, and is recorded;
#   APPLIED  what is trained: refused unless asked (--allow-config-change), then applied from the
#            next step (optimizer settings included) and recorded in config_changes.jsonl;
#   FIXED    what the checkpoint was built from: refused always (a new run in another output_dir).
# Every key has an entry (a test holds this table to the dataclass's fields, as RULES).

FREE, APPLIED, FIXED = "free", "applied", "fixed"

RESUME_CHANGES: dict[str, str] = {
    "model_name_or_path": FIXED,  # the weights (the base of a LoRA adapter) the run started from
    "base_model": FREE,  # a name on the model card
    "query_task": APPLIED,
    "document_task": APPLIED,
    "max_prompt_tokens": APPLIED,
    "max_response_tokens": APPLIED,
    "objective": FIXED,  # supervised and unsupervised GRACE are different methods (Eqs. 5-9 vs 13)
    "data_dir": FREE,  # where the data is, not which: a changed data size is warned of on resume
    "train_data": APPLIED,  # the data mix
    "eval_data": FREE,
    "num_negatives": APPLIED,
    "batch_sampling": APPLIED,
    "bad_rows": FREE,  # skip or refuse: the rows trained on are the same
    "num_rollouts": APPLIED,
    "temperature_positive": APPLIED,
    "temperature_query": APPLIED,
    "temperature_negative": APPLIED,
    "top_p": APPLIED,
    "rollout_backend": APPLIED,  # another sampler implementation
    "rollout_batch_size": FREE,  # rows generated at once: memory
    "rollout_bucket_ratio": FREE,
    "vllm_gpu_memory_utilization": FREE,
    "vllm_tensor_parallel_size": FREE,
    "vllm_enable_sleep_mode": FREE,
    "reward_mode": APPLIED,
    "lambda_consistency": APPLIED,
    "lambda_hard_negative": APPLIED,
    "tau": APPLIED,
    "gamma": APPLIED,
    "length_penalty_mode": APPLIED,
    "length_penalty_units": APPLIED,
    "mask_truncated": APPLIED,
    "scale_rewards": APPLIED,
    "contrastive_beta": APPLIED,
    "contrastive_temperature": APPLIED,
    "contrastive_anchors": APPLIED,
    "warm_start_steps": APPLIED,  # which steps are warm is a function of the step
    "graded_scale": APPLIED,
    "finetune": FIXED,  # full weights or an adapter: the checkpoint holds one or the other
    "lora_r": FIXED,  # the adapter's shapes
    "lora_alpha": FIXED,  # rescales the trained adapter at once, without a step
    "lora_dropout": APPLIED,
    "lora_target_modules": FIXED,
    "learning_rate": APPLIED,  # the optimizer's and the schedule's rates are set to it on resume
    "lr_scheduler": APPLIED,
    "warmup_steps": APPLIED,
    "weight_decay": APPLIED,
    "adam_beta1": APPLIED,
    "adam_beta2": APPLIED,
    "adam_epsilon": APPLIED,
    "max_grad_norm": APPLIED,
    "ppo_epochs": APPLIED,
    "clip_epsilon": APPLIED,
    "kl_coef": APPLIED,
    "gradient_accumulation_steps": APPLIED,  # the hybrid term sees the chunks (trainer.update)
    "share_prompt_pass": FREE,  # the same loss and gradients
    "batch_size": APPLIED,
    "epochs": FREE,  # the run's length (a linear schedule decays over the new length)
    "max_steps": FREE,
    "seed": APPLIED,  # the data order and the rollouts' seeds
    "bf16": APPLIED,  # the precision of every pass
    "gradient_checkpointing": FREE,  # recomputes the same activations
    "output_dir": FREE,
    "logging_steps": FREE,
    "save_steps": FREE,
    "save_total_limit": FREE,
    "eval_steps": FREE,
    "eval_max_examples": FREE,
    "eval_batch_size": FREE,
    "report_to": FREE,
    "push_to_hub": FREE,
    "hub_model_id": FREE,
    "hub_private": FREE,
    "push_steps": FREE,
    "hub_retry_backoff_s": FREE,
    "hub_final_wait_s": FREE,
    "infonce_learning_rate": FREE,  # the InfoNCE baseline's, not GRPO's
    "infonce_batch_size": FREE,
    "infonce_temperature": FREE,
}


@functools.cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(GRPOConfig)


def _combination_rules(config: GRPOConfig) -> list[tuple[bool, str, str]]:
    """(holds, the key to blame, message) for rules that tie several keys together."""
    graded = any(isinstance(source, dict) and source.get("type") == "sts" for source in config.train_data or ())
    return [
        (
            config.finetune == "full" or config.rollout_backend == "hf",
            "finetune",
            "finetune: lora needs rollout_backend: hf (the vLLM engine syncs full weights, not an adapter)",
        ),
        (config.epochs >= 1 or config.max_steps > 0, "epochs", "epochs: set epochs >= 1 or max_steps > 0"),
        (
            config.warm_start_steps == 0 or config.contrastive_beta > 0,
            "warm_start_steps",
            "warm_start_steps: the warm start trains β · InfoNCE alone (K = 1 has no advantage); "
            + "it needs contrastive_beta > 0",
        ),
        (
            not graded or (config.batch_sampling == "by_source" and config.contrastive_beta > 0),
            "train_data",
            "train_data: an 'sts' source (graded pairs) trains β · CoSENT on batches of its own: it needs "
            + "batch_sampling: by_source and contrastive_beta > 0",
        ),
        (
            config.temperature_positive > 0 or config.num_rollouts == 1,
            "temperature_positive",
            "temperature_positive: K > 1 positive rollouts need temperature_positive > 0, or every rollout is the same",
        ),
        (not config.push_to_hub or bool(config.hub_model_id), "hub_model_id", "push_to_hub needs hub_model_id"),
    ]


def _check_source(where: str, source: Any) -> None:
    from .data import SOURCE_TYPES

    if not isinstance(source, dict) or "type" not in source or "path" not in source:
        raise ConfigError(f"{where}: each data source needs 'type' and 'path', got {source!r}", key=where.split("[")[0])
    if source["type"] not in SOURCE_TYPES:
        raise ConfigError(
            f"{where}.type: {source['type']!r} is not a data source type; one of {', '.join(SOURCE_TYPES)}",
            key=where.split("[")[0],
        )
    if not isinstance(source["path"], str) or not source["path"]:
        raise ConfigError(f"{where}.path: expected a non-empty string, got {source['path']!r}", key=where.split("[")[0])


def _with_suggestion(key: str) -> str:
    close = difflib.get_close_matches(key, list(_hints()), n=1)
    return f"{key} (did you mean {close[0]}?)" if close else key


# -- what needs the data or the machine ----------------------------------------------------------


def check_batches(config: GRPOConfig, instances: int, world_size: int = 1) -> None:
    """The batch the run takes every step must exist in the data and split over the processes."""
    if instances == 0 and not config.train_data:
        raise ConfigError("train_data: no training data (the list of sources is empty)", key="train_data")
    if instances < config.batch_size:
        raise ConfigError(
            f"batch_size: {instances} training instances, fewer than one batch of {config.batch_size}",
            key="batch_size",
        )
    if config.batch_size % world_size:
        raise ConfigError(
            f"batch_size: {config.batch_size} must divide evenly over {world_size} processes", key="batch_size"
        )


def check_environment(config: GRPOConfig) -> None:
    """Settings this machine cannot run, refused before any model is loaded."""
    if config.bf16:
        import torch

        if not torch.cuda.is_available():
            # On CPU accelerate's bf16 autocast leaves float32 weights meeting bfloat16
            # activations, and step 1 dies with "Float did not match BFloat16".
            raise ConfigError("bf16: true needs a CUDA GPU and none is available; set bf16: false", key="bf16")
        if not torch.cuda.is_bf16_supported():
            raise ConfigError("bf16: true, but this GPU has no bfloat16 support; set bf16: false", key="bf16")
    output = Path(config.output_dir)
    if output.exists() and not output.is_dir():
        raise ConfigError(f"output_dir: {output} exists and is not a directory", key="output_dir")
    from .run_dir import forbidden_output_dir

    reason = forbidden_output_dir(output)
    if reason:
        message = f"output_dir: {output} is {reason}; a run writes and deletes checkpoints there, give it its own"
        raise ConfigError(message, key="output_dir")


class LaunchError(RuntimeError):
    """The processes were started in a way that would not run what was asked for."""


def check_launch(environ: Mapping[str, str] | None = None) -> None:
    """Refuse a launch that would silently train in fewer processes than asked for.

    ``accelerate launch --cpu --num_processes N`` starts one process unless ``mpirun`` is
    used (its simple launcher sets ``MASTER_ADDR`` for N > 1 but starts one Python). Several
    CPU processes come from ``accelerate launch --multi_gpu --num_processes N`` or ``torchrun
    --nproc_per_node N``: the trainer runs them over gloo when there is no GPU.
    """
    env = os.environ if environ is None else environ
    cpu_flag = env.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    launched = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")  # torchrun, MPI
    if cpu_flag and env.get("MASTER_ADDR") and not any(key in env for key in launched):
        raise LaunchError(
            "`accelerate launch --cpu --num_processes N` starts a single process (accelerate needs mpirun "
            "for more); for N CPU processes run `accelerate launch --multi_gpu --num_processes N -m "
            "grace_training.cli ...` or `torchrun --nproc_per_node N -m grace_training.cli ...` "
            "(without a GPU they train on CPU over gloo); if one process is meant, unset MASTER_ADDR"
        )


# -- reading ---------------------------------------------------------------------------------------


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """A config file's keys; an unreadable, non-UTF-8, invalid or non-mapping file is a ConfigError naming it."""
    import yaml

    try:
        text = Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError("no such config file", source=str(path)) from None
    except IsADirectoryError:
        raise ConfigError("is a directory, not a config file", source=str(path)) from None
    except OSError as error:
        raise ConfigError(f"cannot read it ({error.strerror or error})", source=str(path)) from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"not UTF-8 text (byte {error.start}: {error.reason})", source=str(path)) from None
    try:
        values = yaml.load(text, Loader=_strict_loader())
    except yaml.YAMLError as error:
        raise ConfigError(f"invalid YAML: {_yaml_problem(error)}", source=_yaml_position(path, error)) from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"expected a mapping of config keys, got a {type(values).__name__}", source=str(path))
    return values


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["lr=1e-5", "report_to=[jsonl]"]`` → ``{"lr": 1e-5, "report_to": ["jsonl"]}``."""
    import yaml

    parsed: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value (values are parsed as YAML)")
        try:
            parsed[key] = yaml.load(raw, Loader=_strict_loader()) if raw.strip() else None
        except yaml.YAMLError as error:
            message = f"{key}: invalid YAML value: {_yaml_problem(error)}"
            raise ConfigError(message, key=key, source=f"override {item}") from None
    return parsed


def locate(error: ConfigError, path: str | Path, overrides: list[str] | None = None) -> ConfigError:
    """Say where the blamed value came from: the last ``key=value`` override of its key, else the file."""
    if error.source is not None:
        return error
    matching = [item for item in overrides or [] if item.partition("=")[0].strip() == error.key]
    return error.located(f"override {matching[-1]}" if matching else str(path))


def _yaml_problem(error: Exception) -> str:
    problem = getattr(error, "problem", None) or str(error)
    context = getattr(error, "context", None)
    return f"{context}, {problem}" if context else problem


def _yaml_position(path: str | Path, error: Exception) -> str:
    mark = getattr(error, "problem_mark", None)
    return f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)


@functools.cache
def _strict_loader():
    import yaml

    class StrictLoader(yaml.SafeLoader):
        """SafeLoader that refuses a key written twice (YAML keeps the last one without a word)."""

        def construct_mapping(self, node, deep=False):
            seen = []
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark
                    )
                seen.append(key)
            return super().construct_mapping(node, deep=deep)

    return StrictLoader
