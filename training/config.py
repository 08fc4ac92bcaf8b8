"""One dataclass with every training setting; its defaults are the paper's (method.md §2).

A YAML file holds the same keys (``training/configs/paper.yaml`` is the paper's run); the CLI
overrides any key with ``key=value``. Paper values that differ between the paper's text and
its reference code are noted where they are set.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REWARD_MODES = ("paper", "per_rollout")
OBJECTIVES = ("supervised", "unsupervised")
BACKENDS = ("hf", "vllm")
LENGTH_PENALTY_MODES = ("add", "replace", "off")
LENGTH_PENALTY_UNITS = ("scaled", "reward")
REWARD_SCALING = ("none", "group")
FINETUNE_MODES = ("full", "lora")
CONTRASTIVE_ANCHORS = ("detached", "recompute")
BAD_ROWS = ("skip", "error")


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
    max_prompt_tokens: int = 1024  # paper: prompt ≤ 1024 tokens
    max_response_tokens: int = 2048  # paper: rationale ≤ 2048 tokens in training

    # -- data -------------------------------------------------------------------------------
    objective: str = "supervised"  # "unsupervised": raw text, Eqs. 12–13
    data_dir: str | None = None  # relative source paths resolve against it (e.g. ../shared/data)
    train_data: list[dict[str, Any]] = field(default_factory=list)
    eval_data: list[dict[str, Any]] = field(default_factory=list)
    num_negatives: int = 1  # negatives per triplet used in Eq. 5 (extra ones are dropped)
    bad_rows: str = "skip"  # "skip": report (file, line) and go on; "error": refuse before training

    # -- rollouts (Eq. 4) -------------------------------------------------------------------
    num_rollouts: int = 8  # K, rationales per positive
    temperature_positive: float = 1.0  # paper: K positive rollouts at 1.0
    temperature_query: float = 0.5  # reference code: queries and negatives at 0.5
    temperature_negative: float = 0.5
    top_p: float = 1.0
    rollout_backend: str = "hf"  # "vllm": an engine in this process (GPU), see vllm_backend.py
    rollout_batch_size: int = 64  # rows generated at once by the HF backend (memory bound)
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
    contrastive_anchors: str = "detached"  # queries and negatives: rollout embeddings, or recomputed with gradient

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

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting (the CLI's --dry-run calls this)."""
        checks = [
            (self.objective in OBJECTIVES, f"objective must be one of {OBJECTIVES}"),
            (self.reward_mode in REWARD_MODES, f"reward_mode must be one of {REWARD_MODES}"),
            (self.rollout_backend in BACKENDS, f"rollout_backend must be one of {BACKENDS}"),
            (self.length_penalty_mode in LENGTH_PENALTY_MODES, f"length_penalty_mode: one of {LENGTH_PENALTY_MODES}"),
            (self.length_penalty_units in LENGTH_PENALTY_UNITS, f"length_penalty_units: one of {LENGTH_PENALTY_UNITS}"),
            (self.scale_rewards in REWARD_SCALING, f"scale_rewards must be one of {REWARD_SCALING}"),
            (self.finetune in FINETUNE_MODES, f"finetune must be one of {FINETUNE_MODES}"),
            (self.contrastive_anchors in CONTRASTIVE_ANCHORS, f"contrastive_anchors: one of {CONTRASTIVE_ANCHORS}"),
            (self.contrastive_beta >= 0, "contrastive_beta (β) must be >= 0"),
            (self.contrastive_temperature > 0, "contrastive_temperature must be > 0"),
            (self.lora_r >= 1 and self.lora_alpha > 0, "lora_r must be >= 1 and lora_alpha > 0"),
            (0 <= self.lora_dropout < 1, "lora_dropout must be in [0, 1)"),
            (
                self.finetune == "full" or self.rollout_backend == "hf",
                "finetune: lora needs rollout_backend: hf (the vLLM engine syncs full weights, not an adapter)",
            ),
            (self.bad_rows in BAD_ROWS, f"bad_rows must be one of {BAD_ROWS}"),
            (self.lr_scheduler in ("constant", "linear"), "lr_scheduler must be 'constant' or 'linear'"),
            (self.num_rollouts >= 1, "num_rollouts (K) must be >= 1"),
            (self.batch_size >= 1, "batch_size must be >= 1"),
            (self.num_negatives >= 0, "num_negatives must be >= 0"),
            (self.tau > 0, "tau must be > 0"),
            (self.gamma >= 0, "gamma must be >= 0"),
            (self.max_response_tokens >= 1, "max_response_tokens must be >= 1 (GRPO needs a rationale)"),
            (self.max_prompt_tokens >= 1, "max_prompt_tokens must be >= 1"),
            (self.ppo_epochs >= 1, "ppo_epochs must be >= 1"),
            (self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be >= 1"),
            (self.rollout_batch_size >= 1, "rollout_batch_size must be >= 1"),
            (self.epochs >= 1 or self.max_steps > 0, "set epochs >= 1 or max_steps > 0"),
            (
                min(self.temperature_positive, self.temperature_query, self.temperature_negative) >= 0,
                "temperatures must be >= 0 (0 is greedy)",
            ),
            (
                self.temperature_positive > 0 or self.num_rollouts == 1,
                "K > 1 positive rollouts need temperature_positive > 0, or every rollout is the same",
            ),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 < self.vllm_gpu_memory_utilization <= 1, "vllm_gpu_memory_utilization must be in (0, 1]"),
            (self.save_total_limit is None or self.save_total_limit >= 1, "save_total_limit must be >= 1 or null"),
            (not self.push_to_hub or bool(self.hub_model_id), "push_to_hub needs hub_model_id"),
            (set(self.report_to) <= {"jsonl", "tensorboard"}, "report_to takes 'jsonl' and 'tensorboard'"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        for source in [*self.train_data, *self.eval_data]:
            if not isinstance(source, dict) or "type" not in source or "path" not in source:
                raise ValueError(f"each data source needs 'type' and 'path', got {source!r}")

    # -- (de)serialisation --------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> GRPOConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown config key(s): {', '.join(unknown)}")
        return cls(**{key: _coerce(cls.__dataclass_fields__[key].type, value) for key, value in values.items()})

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> GRPOConfig:
        """Read a YAML file, then apply ``key=value`` overrides (values parsed as YAML)."""
        import yaml

        values = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        if not isinstance(values, dict):
            raise TypeError(f"{path}: expected a mapping of config keys")
        values.update(parse_overrides(overrides or []))
        return cls.from_dict(values)

    def to_yaml(self, path: str | Path) -> None:
        import yaml

        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False), encoding="utf-8")

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


def _coerce(annotation: str, value: Any) -> Any:
    """YAML 1.1 reads ``1e-6`` as a string; numbers are turned back into numbers here."""
    if not isinstance(value, str):
        return value
    kinds = {part.strip() for part in str(annotation).split("|")}
    for name, kind in (("int", int), ("float", float)):
        if name in kinds:
            try:
                return kind(value)
            except ValueError:
                continue
    return value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["lr=1e-5", "report_to=[jsonl]"]`` → ``{"lr": 1e-5, "report_to": ["jsonl"]}``."""
    import yaml

    parsed: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not key=value")
        parsed[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
    return parsed
