"""One dataclass with every training setting; its defaults are the paper's (method.md §2).

A YAML file holds the same keys (``grace_training/configs/paper.yaml`` is the paper's run); the CLI
overrides any key with ``key=value``. Paper values that differ between the paper's text and
its reference code are noted where they are set.

Each key is one field (:func:`key`): its type, default, what it does, its range rules and what
``--resume`` does when it changed. ``RULES``, ``RESUME_CHANGES``, the model card's summary and the docs'
table (:func:`config_table`, ``python -m grace_training.config.train_config``) are read from the fields, so a new key
is added in one place. The keys are flat, whatever the algorithm: which ones an algorithm alone reads, and which
others it refuses, its record says (:mod:`grace_training.algorithms.registry`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
import os
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

from grace_st.settings import PROMPT_FORMATS, PROMPT_TYPES, per_prompt_type, unknown_prompt_types
from grace_training.algorithms.registry import ALGORITHMS, OLD_NAMES
from grace_training.config.output_dirs import forbidden_output_dir
from grace_training.config.validation import (
    NON_EMPTY,
    ConfigError,
    Rule,
    above,
    at_least,
    between,
    check_value,
    coerce,
    one_of,
    subset_of,
)
from grace_training.data.sampling import SAMPLINGS

logger = logging.getLogger(__name__)

REWARD_MODES = ("paper", "per_rollout")
OBJECTIVES = ("supervised", "unsupervised")
BACKENDS = ("hf", "vllm")
LENGTH_PENALTY_MODES = ("add", "replace", "off")
LENGTH_PENALTY_UNITS = ("scaled", "reward")
REWARD_SCALING = ("none", "group")
# Whose greedy response GRC's L_Gen teacher-forces: the model being trained, or the model training started from.
GRC_RESPONSE_TARGETS = ("policy", "start")
FINETUNE_MODES = ("full", "lora")
CONTRASTIVE_ANCHORS = ("detached", "recompute", "recompute_prompts")
BAD_ROWS = ("skip", "error")
LR_SCHEDULERS = ("constant", "linear")


# -- each key's rules, and what a resume may change ----------------------------------------------
# Types come from the annotations; a key's range rules and its resume kind sit in its field (``key``).
# A resumed run goes on under the config it is given; each key changed since the checkpoint is one of
#   FREE     bookkeeping, the run's length, how (not what) it computes: changes, and is recorded;
#   APPLIED  what is trained: refused unless asked (--allow-config-change), then applied from the
#            next step (optimizer settings included) and recorded in config_changes.jsonl;
#   FIXED    what the checkpoint was built from: refused always (a new run in another output_dir).

FREE, APPLIED, FIXED = "free", "applied", "fixed"
POSITIVE, NON_NEGATIVE, AT_LEAST_ONE = above(0), at_least(0), at_least(1)
PROBABILITY_OPEN_TOP = between(0, 1, high_open=True)
REPORTERS = ("jsonl", "tensorboard")
SEED_RANGE = between(0, 2**32 - 1)  # NumPy's seeding takes nothing outside [0, 2**32)
REPO_ID = Rule(
    lambda value: len(value.split("/")) <= 2 and all(value.split("/")) and not any(c.isspace() for c in value),
    "be 'name' or 'owner/name' without spaces",
)
BUDGETS = Rule(
    lambda v: v >= 1 if not isinstance(v, dict) else per_prompt_type(0)(v) and max(v.values()) >= 1,
    "be an integer >= 1, or a mapping of prompt type to an integer >= 0 with a 'default' entry and one >= 1"
    " (GRPO needs a rationale)",
)
# Old names of keys, still read from YAML files, overrides and saved configs (with a warning).
ALIASES = {"max_prompt_tokens": "max_input_tokens", "max_response_tokens": "max_rationale_tokens", "method": "algorithm"}
# Old values under an old key name: the training config's `method` named the algorithm, and GIRCSE's was `gircse`.
OLD_VALUES = {"method": OLD_NAMES}
# Read when a config is checked, so an algorithm registered later (a test's) is one a config may name.
REGISTERED = Rule(lambda value: value in ALGORITHMS, f"name a registered algorithm ({', '.join(ALGORITHMS)})")


def key(default: Any = MISSING, doc: str = "", *rules: Rule, resume: str, card: bool = False, factory=MISSING):
    """A config key: its default, what it does (``doc``, the docs table's text), its range ``rules``, what
    ``--resume`` does when it changed (``resume``: FREE, APPLIED or FIXED) and whether the model card lists
    it (``card``)."""
    metadata = {"doc": doc, "rules": rules, "resume": resume, "card": card}
    return field(default=default, default_factory=factory, metadata=metadata)


@dataclass
class TrainConfig:
    """A training run's settings, whatever its algorithm (GRACE's defaults are the paper's: Eqs. 4–11, 28).

    Data sources (``train_data`` / ``eval_data``) are dicts, one per source, e.g.
    ``{"type": "beir", "path": "scifact", "split": "train", "num_negatives": 1}``;
    see :func:`grace_training.data.examples.load_source` for every type and option.
    """

    # -- model ------------------------------------------------------------------------------
    model_name_or_path: str | None = key(
        None, "the model to train; null: the untrained embedded SmolLM2 (`default_model_path(trained=False)`)",
        NON_EMPTY, resume=FIXED,  # the weights (the base of a LoRA adapter) the run started from
    )
    base_model: str | None = key(
        None, "the Hub id model cards name as the base (default: `model_name_or_path` when it is a Hub id)",
        NON_EMPTY, resume=FREE,
    )
    query_task: str = key("query", "the encoder's instruction P(·) queries are wrapped in", NON_EMPTY, resume=APPLIED)
    document_task: str = key(
        "document", "the instruction of positives and negatives (`default` for symmetric data)", NON_EMPTY,
        resume=APPLIED,
    )
    # The encoder's own names: the saved model encodes with them (paper: prompt ≤ 1024, rationale ≤ 2048).
    max_input_tokens: int = key(1024, "prompt limit (the paper's 1024)", AT_LEAST_ONE, resume=APPLIED, card=True)
    max_rationale_tokens: int | dict[str, int] = key(
        2048, "rationale limit (the paper's 2048), or budgets by prompt type as the encoder takes them, e.g. "
        "`{default: 32, query: 32, document: 0}`: each side is trained at the budget it is encoded with, and a "
        "retrieval source whose documents get 0 rolls out its queries",
        BUDGETS, resume=APPLIED, card=True,
    )

    # -- data -------------------------------------------------------------------------------
    objective: str = key(
        "supervised", "`unsupervised`: raw text, an anchor rollout and K rollouts of x (Eqs. 12–13)",
        one_of(OBJECTIVES), resume=FIXED, card=True,  # supervised and unsupervised GRACE are different methods
    )
    data_dir: str | None = key(
        None, "relative source paths resolve against it (e.g. `../shared/data`)", NON_EMPTY,
        resume=FREE,  # where the data is, not which: a changed data size is warned of on resume
    )
    train_data: list[dict[str, Any]] = key(
        doc="training sources, one dict each (Data, below)", resume=APPLIED, factory=list
    )  # each source is checked by _check_source; empty is refused where data is loaded
    eval_data: list[dict[str, Any]] = key(doc="evaluation sources (the dev curve)", resume=FREE, factory=list)
    num_negatives: int = key(
        1, "negatives a triplet takes into Eq. 5 (extra ones are dropped)", NON_NEGATIVE, resume=APPLIED, card=True
    )
    batch_sampling: str = key(
        "shuffled", "`shuffled`: one permutation of all triplets an epoch; `by_source`: each step's batch from "
        "one source, drawn by the sources' `weight`", one_of(SAMPLINGS), resume=APPLIED,
    )
    bad_rows: str = key(
        "skip", "`skip`: report each bad row (file, line) and go on; `error`: refuse before training",
        one_of(BAD_ROWS), resume=FREE,  # the rows trained on are the same
    )

    # -- rollouts (Eq. 4) -------------------------------------------------------------------
    num_rollouts: int = key(8, "K, rationales per positive", AT_LEAST_ONE, resume=APPLIED, card=True)
    temperature_positive: float = key(
        1.0, "the K positive rollouts' temperature (paper: 1.0; 0 is greedy)", NON_NEGATIVE, resume=APPLIED, card=True
    )
    temperature_query: float = key(
        0.5, "queries' rollout temperature (the reference code's 0.5)", NON_NEGATIVE, resume=APPLIED, card=True
    )
    temperature_negative: float = key(
        0.5, "negatives' rollout temperature (the reference code's 0.5)", NON_NEGATIVE, resume=APPLIED, card=True
    )
    top_p: float = key(1.0, "nucleus sampling of every rollout", between(0, 1, low_open=True), resume=APPLIED)
    rollout_backend: str = key(
        "hf", "`vllm`: an engine in this process (GPU, `vllm_backend.py`)", one_of(BACKENDS),
        resume=APPLIED,  # another sampler implementation
    )
    rollout_batch_size: int = key(64, "rows the HF backend generates at once (memory)", AT_LEAST_ONE, resume=FREE)
    rollout_bucket_ratio: float | None = key(
        None, "HF rollouts in length buckets: a chunk also closes where prompts grow past this ratio of its "
        "shortest; measured slower at the shipped settings (decisions/D008)", at_least(1), resume=FREE,
    )
    vllm_gpu_memory_utilization: float = key(
        0.5, "the vLLM engine's share of the GPU (paper: 50 %)", between(0, 1, low_open=True), resume=FREE
    )
    vllm_tensor_parallel_size: int = key(1, "GPUs the vLLM engine spans", AT_LEAST_ONE, resume=FREE)
    vllm_enable_sleep_mode: bool = key(False, "the vLLM engine frees its memory during the update", resume=FREE)

    # -- rewards (Eqs. 5–9, 13, 28) ---------------------------------------------------------
    reward_mode: str = key(
        "paper", "`per_rollout`: negatives act through each rollout (method.md §2)", one_of(REWARD_MODES),
        resume=APPLIED, card=True,
    )
    lambda_consistency: float = key(
        0.2, "λ1 (Eq. 8); 0 for the ablation", NON_NEGATIVE,  # a negative weight would reward the opposite
        resume=APPLIED, card=True,
    )
    lambda_hard_negative: float = key(0.2, "λ2 (Eq. 8)", NON_NEGATIVE, resume=APPLIED, card=True)
    tau: float = key(
        10.0, "Eq. 9, R̂ = R_total / τ (the paper's text; the reference code divides by 0.1, rewards ×10)",
        POSITIVE, resume=APPLIED, card=True,
    )
    gamma: float = key(1.0, "γ, Eq. 28's length penalty", NON_NEGATIVE, resume=APPLIED, card=True)
    length_penalty_mode: str = key(
        "add", "Eq. 28: `add` (R̂ − γ for a rollout cut at the limit), `replace` (its reward is −γ, the reference "
        "code), `off`", one_of(LENGTH_PENALTY_MODES), resume=APPLIED, card=True,
    )
    length_penalty_units: str = key(
        "scaled", "`scaled`: γ in R̂'s units (paper); `reward`: in cosine units, applied as γ/τ so it keeps its "
        "size relative to the contrastive terms", one_of(LENGTH_PENALTY_UNITS), resume=APPLIED, card=True,
    )
    mask_truncated: bool = key(
        False, "rollouts cut at the limit leave Eq. 11 (TRL's `mask_truncated_completions`, DAPO)",
        resume=APPLIED, card=True,
    )
    scale_rewards: str = key(
        "none", "`group`: Eq. 10's advantages divided by the group's std (DeepSeek GRPO); `none`: Dr. GRPO, "
        "the paper", one_of(REWARD_SCALING), resume=APPLIED, card=True,
    )

    # -- hybrid objective (beyond the paper) -----------------------------------------------------
    contrastive_beta: float = key(
        0.0, "β of the hybrid objective: + β · InfoNCE on the update pass's pooled states; 0 is the paper's GRACE",
        NON_NEGATIVE, resume=APPLIED, card=True,
    )
    contrastive_temperature: float = key(0.05, "the InfoNCE term's temperature", POSITIVE, resume=APPLIED, card=True)
    contrastive_anchors: str = key(
        "detached", "queries and negatives of the hybrid term: the rollouts' embeddings (`detached`), pooled "
        "again with gradient (`recompute`), or only where embedded from the prompt alone (`recompute_prompts`: "
        "a retrieval source's documents under budget 0)", one_of(CONTRASTIVE_ANCHORS), resume=APPLIED, card=True,
    )
    warm_start_steps: int = key(
        0, "the first N steps roll out one greedy rationale a text (K = 1, temperatures 0): no advantage, so "
        "β · InfoNCE alone trains, at about half a step's cost; then the configured K and temperatures. Needs β > 0",
        NON_NEGATIVE, resume=APPLIED, card=True,  # which steps are warm is a function of the step
    )
    graded_scale: float = key(
        20.0, "λ of the graded term: a step drawn from an `sts` source (scored pairs, every score kept) rolls out "
        "one greedy rationale a text and trains β · CoSENT, log(1 + Σ_{s_i > s_j} exp(λ (c_j − c_i))) over the "
        "batch's pooled cosines c and gold scores s, instead of β · InfoNCE. Needs `batch_sampling: by_source`, β > 0",
        POSITIVE, resume=APPLIED,
    )

    # -- GIRCSE: soft tokens trained end to end (gircse.md, Eqs. 7–8) ---------------------------
    algorithm: str = key(
        "grpo", "what trains the model, and how the saved model thinks: " + "; ".join(
            f"`{record.name}`, {record.summary} (`method: {record.method}`)" for record in ALGORITHMS.values()
        ) + ". An algorithm's own keys apply to it alone (docs/training.md, Algorithms)",
        REGISTERED, resume=FIXED, card=True,
    )
    icr_temperature: float = key(0.02, "τ of Eq. 7's InfoNCE (icr; the paper's 0.02)", POSITIVE, resume=APPLIED, card=True)
    icr_lambda: float = key(
        1.0, "λ of Eq. 8 (icr): the weight of the penalty on a step whose loss is above the step before's",
        NON_NEGATIVE, resume=APPLIED, card=True,
    )
    # -- GRC: latent tokens, Eq. 5 (grc.md) ----------------------------------------------------
    num_latent_tokens: int = key(
        16, "m, the meta latent tokens (grc); the saved model's `num_latent_tokens`", AT_LEAST_ONE, resume=FIXED,
        card=True,
    )
    grc_alpha: float = key(1.0, "α of Eq. 5: L_Gen, cross-entropy on the response y (grc)", NON_NEGATIVE,
                           resume=APPLIED, card=True)
    grc_beta: float = key(
        1.0, "β of Eq. 5: L_Recons, cross-entropy on the text rebuilt from the latents alone (grc)", NON_NEGATIVE,
        resume=APPLIED, card=True,
    )
    grc_gamma: float = key(1.0, "γ of Eq. 5: L_Rep, InfoNCE on the latents' embeddings (grc)", NON_NEGATIVE,
                           resume=APPLIED, card=True)
    grc_scale: float = key(
        20.0, "τ of Eq. 4 (grc): InfoNCE's logits are τ · cos (a scale, not a divisor: 20 is a temperature of 0.05)",
        POSITIVE, resume=APPLIED, card=True,
    )
    max_reconstruction_tokens: int = key(
        128, "the text's tokens the reconstruction turn rebuilds (grc; longer texts are cut)", AT_LEAST_ONE,
        resume=APPLIED, card=True,
    )
    grc_response_targets: str = key(
        "policy", "whose greedy response y is L_Gen's target (grc, Eq. 2): `policy`, the model being trained (its "
        "own answer, teacher-forced; the answers drift to \"None\" within 125 steps, decisions/D035); "
        "`start`, the start model's (the LoRA adapter disabled, or under full fine-tuning a frozen copy of the start "
        "model: the answer held where training began)",
        one_of(GRC_RESPONSE_TARGETS), resume=FIXED, card=True,
    )
    prompt_format: str = key(
        "chat", "how the saved model wraps a text (the encoder's `prompt_format`): `chat`, the chat template; "
        "`instruct`, GIRCSE's reference string `Instruct: {instruction}\\nQuery:{text}` with the soft tokens right "
        "after the text (algorithm icr only)", one_of(PROMPT_FORMATS), resume=FIXED, card=True,
    )
    instructions: dict[str, str] | None = key(
        None, "the saved model's instructions by prompt type (a 'default' entry; '' wraps nothing: the reference "
        "format's documents); null: the start model's", resume=FIXED, card=True,
    )

    # -- what is trained ----------------------------------------------------------------------
    finetune: str = key(
        "full", "`lora`: a PEFT LoRA adapter on a frozen base (the KL reference is the adapter disabled)",
        one_of(FINETUNE_MODES), resume=FIXED, card=True,  # the checkpoint holds full weights or an adapter
    )
    lora_r: int = key(8, "the adapter's rank", AT_LEAST_ONE, resume=FIXED, card=True)  # its shapes
    lora_alpha: int = key(
        16, "the adapter's scale α (ΔW · α / r)", POSITIVE, resume=FIXED, card=True  # rescales it at once, no step
    )
    lora_dropout: float = key(0.0, "dropout on the adapter's input", PROBABILITY_OPEN_TOP, resume=APPLIED)
    lora_target_modules: list[str] | str = key(
        "all-linear", "the layers the adapter wraps (PEFT's `target_modules`)", NON_EMPTY, resume=FIXED
    )
    init_adapter: str | None = key(
        None, "a LoRA adapter directory (PEFT's two files: a shipped adapter or a run's checkpoint) whose weights the "
        "adapter starts from, with a fresh optimizer; its layers must be the config's, its rank and α too, or a lower "
        "rank, which grows to the config's with ΔW unchanged (new directions start at zero). The KL references "
        "stay the base (the adapter disabled). null: PEFT's initialisation (ΔW = 0)",
        NON_EMPTY, resume=FIXED, card=True,  # the weights the run started from
    )

    # -- policy optimisation (Eqs. 10–11) ---------------------------------------------------
    learning_rate: float = key(
        1e-6, "AdamW's rate (set on the optimizer and the schedule on resume)", POSITIVE, resume=APPLIED, card=True
    )
    lr_scheduler: str = key("constant", "`linear`: decays to 0 over the run", one_of(LR_SCHEDULERS), resume=APPLIED)
    warmup_steps: int = key(0, "linear warm-up steps", NON_NEGATIVE, resume=APPLIED)
    weight_decay: float = key(0.0, "AdamW's weight decay", NON_NEGATIVE, resume=APPLIED)
    adam_beta1: float = key(0.9, "AdamW's β1 (< 1)", PROBABILITY_OPEN_TOP, resume=APPLIED)
    adam_beta2: float = key(0.999, "AdamW's β2 (< 1)", PROBABILITY_OPEN_TOP, resume=APPLIED)
    adam_epsilon: float = key(1e-8, "AdamW's ε", POSITIVE, resume=APPLIED)
    max_grad_norm: float = key(1.0, "gradient clipping; 0: none", NON_NEGATIVE, resume=APPLIED)
    ppo_epochs: int = key(
        1, "optimisation passes over one batch's rollouts; > 1 uses the clipped ratio", AT_LEAST_ONE, resume=APPLIED
    )
    clip_epsilon: float = key(0.2, "the ratio's clip range (Eq. 11)", POSITIVE, resume=APPLIED)
    kl_coef: float = key(0.0, "> 0: KL to the initial model (k3 estimator), keeps a frozen copy", NON_NEGATIVE,
                         resume=APPLIED)
    text_kl_coef: float = key(
        0.0, "> 0: KL(initial model ‖ policy) of the next-token distribution at every position of the text being "
        "embedded (full vocabulary): holds the LM's perplexity on human text, which kl_coef does not "
        "(decisions/D013); keeps a frozen copy under full fine-tuning", NON_NEGATIVE, resume=APPLIED,
    )
    gradient_accumulation_steps: int = key(
        1, "the step's positive rollouts in this many chunks, one optimiser step", AT_LEAST_ONE,
        resume=APPLIED,  # the hybrid term sees the chunks (GRPOStep.update)
    )
    share_prompt_pass: bool = key(
        True, "the update pass runs the prompt K rollouts share once, its keys and values expanded to the K rows "
        "(the same loss and gradients; off with gradient checkpointing, which drops the KV cache)", resume=FREE,
    )

    # -- loop -------------------------------------------------------------------------------
    batch_size: int = key(64, "B triplets a step, over all processes", AT_LEAST_ONE, resume=APPLIED, card=True)
    epochs: int = key(
        2, "passes over the data (0 only with max_steps > 0)", NON_NEGATIVE,
        resume=FREE, card=True,  # the run's length (a linear schedule decays over the new length)
    )
    max_steps: int = key(-1, "> 0: stop there (wins over epochs)", at_least(-1), resume=FREE, card=True)
    seed: int = key(42, "the data order and the rollouts' seeds", SEED_RANGE, resume=APPLIED, card=True)
    bf16: bool = key(False, "mixed precision through accelerate (GPU)", resume=APPLIED)  # every pass's precision
    gradient_checkpointing: bool = key(False, "recompute activations in the backward pass (memory)", resume=FREE)
    output_dir: str = key("runs/grace", "the run's directory (checkpoints, metrics)", NON_EMPTY, resume=FREE)
    logging_steps: int = key(1, "a step logs when step % logging_steps == 0", AT_LEAST_ONE, resume=FREE)
    save_steps: int = key(100, "checkpoint interval; 0: only the final checkpoint", NON_NEGATIVE, resume=FREE)
    save_total_limit: int | None = key(3, "keep the last k checkpoints; null: all", AT_LEAST_ONE, resume=FREE)
    eval_steps: int = key(
        0, "evaluate every N steps; 0: before and after training only (when eval_data is set)", NON_NEGATIVE,
        resume=FREE,
    )
    eval_max_examples: int = key(200, "examples an evaluation source keeps; 0: all", NON_NEGATIVE, resume=FREE)
    eval_seed: int = key(
        42, "the seed of the evaluation sample (eval_max_examples): apart from `seed`, so that runs with other seeds "
        "score the same slice", SEED_RANGE, resume=FREE,
    )
    eval_batch_size: int = key(16, "texts encoded at once in an evaluation", AT_LEAST_ONE, resume=FREE)
    report_to: list[str] = key(
        MISSING, "`jsonl` (metrics.jsonl), `tensorboard`", subset_of(REPORTERS), resume=FREE,
        factory=lambda: ["jsonl", "tensorboard"],
    )

    # -- hub --------------------------------------------------------------------------------
    push_to_hub: bool = key(False, "push checkpoints to the Hub in the background", resume=FREE)
    hub_model_id: str | None = key(None, "the repository pushed to", REPO_ID, resume=FREE)
    hub_private: bool = key(True, "create the repository private", resume=FREE)
    push_steps: int = key(
        0, "0: push every saved checkpoint; N: those whose step is a multiple of N", NON_NEGATIVE, resume=FREE
    )
    hub_retry_backoff_s: float = key(
        5.0, "first wait after a failed push; doubles up to 5 minutes", POSITIVE, resume=FREE
    )
    hub_final_wait_s: float = key(
        600.0, "at the end, wait this long for pending pushes; the journal keeps the rest", NON_NEGATIVE, resume=FREE
    )

    # -- InfoNCE baseline (contrastive.py; the paper's "w/ CL" row) ---------------------------
    infonce_learning_rate: float = key(1e-5, "the baseline's rate (not GRPO's)", POSITIVE, resume=FREE)
    infonce_batch_size: int | None = key(None, "the baseline's batch; null: batch_size", AT_LEAST_ONE, resume=FREE)
    infonce_temperature: float = key(
        0.05, "MultipleNegativesRankingLoss's scale is 1 / temperature", POSITIVE, resume=FREE
    )

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
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        values = canonical_keys(values)
        hints = _hints()
        unknown = sorted(str(key) for key in values if key not in hints)
        if unknown:
            message = f"unknown config key(s): {', '.join(_with_suggestion(k) for k in unknown)}"
            raise ConfigError(message, key=unknown[0])
        return cls(**{key: coerce(value, hints[key]) for key, value in values.items()})

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
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

    @property
    def method(self) -> str:
        """How the trained model thinks (``grace_st.settings.METHODS``): what :attr:`algorithm` trains."""
        return ALGORITHMS[self.algorithm].method

    def data_settings(self) -> dict[str, Any]:
        """The keyword arguments of :func:`grace_training.data.examples.load_data` this config sets."""
        return {name: getattr(self, name) for name in ("bad_rows", "data_dir", "num_negatives", "seed")}

    def rollout_settings(self, step: int | None = None, graded: bool = False) -> dict[str, Any]:
        """The keyword arguments of :func:`grace_training.algorithms.grpo.rollout.asymmetric_rollouts` this config sets (Eq. 4)
        at ``step`` (0-based): within the first ``warm_start_steps``, or for a batch of ``graded`` pairs, one
        greedy rollout a text."""
        names = ("num_rollouts", "num_negatives", "seed", "temperature_query", "temperature_negative",
                 "temperature_positive", "top_p", "query_task", "document_task")
        settings = {"max_new_tokens": self.max_rationale_tokens, **{name: getattr(self, name) for name in names}}
        if graded or (step is not None and step < self.warm_start_steps):
            settings.update(num_rollouts=1, temperature_query=0.0, temperature_negative=0.0, temperature_positive=0.0)
        return settings

    @property
    def longest_response(self) -> int:
        """The largest rationale budget of any prompt type (KV sizes, token estimates)."""
        budgets = self.max_rationale_tokens
        return max(budgets.values()) if isinstance(budgets, dict) else budgets

    def reward_settings(self) -> dict[str, Any]:
        """The keyword arguments of :func:`grace_training.algorithms.grpo.rewards.compute_rewards` this config sets
        (Eqs. 5–9, 13, 28)."""
        names = ("objective", "lambda_consistency", "lambda_hard_negative", "tau", "gamma", "length_penalty_mode",
                 "length_penalty_units")
        return {"mode": self.reward_mode, **{name: getattr(self, name) for name in names}}

    def summary(self) -> dict[str, Any]:
        """The settings worth a line on a model card (the keys marked ``card``; flat, JSON-friendly). The LoRA keys
        only where an adapter was trained: a fully fine-tuned model has none to describe."""
        return {
            item.name: getattr(self, item.name) for item in dataclasses.fields(self)
            if item.metadata["card"] and not (self.finetune == "full" and item.name.startswith("lora_"))
        }

    def __str__(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


# The name of earlier releases, kept importable for one release.
GRPOConfig = TrainConfig

RULES: dict[str, tuple[Rule, ...]] = {item.name: item.metadata["rules"] for item in dataclasses.fields(TrainConfig)}
RESUME_CHANGES: dict[str, str] = {item.name: item.metadata["resume"] for item in dataclasses.fields(TrainConfig)}


def canonical_keys(values: Mapping[str, Any], warn: bool = True) -> dict[str, Any]:
    """``values`` with each old key name (``ALIASES``) under its current one; a warning names each rename."""
    renamed = {}
    for name, value in values.items():
        current = ALIASES.get(name, name)
        if current != name:
            if current in values:
                raise ConfigError(f"{name} is the old name of {current}; give one of them", key=current)
            if warn:
                logger.warning("config key %s is now called %s (the old name still works)", name, current)
        renamed[current] = OLD_VALUES.get(name, {}).get(value, value) if isinstance(value, str) else value
    return renamed


def config_table() -> str:
    """The docs' table of every key (docs/training.md; a test holds it to this function)."""
    rows = ["| key | default | on `--resume` | what it does |", "|---|---|---|---|"]
    for item in dataclasses.fields(TrainConfig):
        default = item.default if item.default is not MISSING else item.default_factory()
        shown = json.dumps(default, ensure_ascii=False) if not isinstance(default, str) else default
        rows.append(f"| `{item.name}` | `{shown}` | {item.metadata['resume']} | {item.metadata['doc']} |")
    return "\n".join(rows)


@functools.cache
def _hints() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def _combination_rules(config: TrainConfig) -> list[tuple[bool, str, str]]:
    """(holds, the key to blame, message) for rules that tie several keys together."""
    graded = any(isinstance(source, dict) and source.get("type") == "sts" for source in config.train_data or ())
    # the types a rollout is encoded as: the encoder's three, and the instructions queries and documents get
    types = list(dict.fromkeys([*PROMPT_TYPES, config.query_task, config.document_task]))
    unknown = unknown_prompt_types(config.max_rationale_tokens, types)
    return [
        (
            not unknown,
            "max_rationale_tokens",
            f"max_rationale_tokens: the prompt type {', '.join(map(repr, unknown))} is no type a text is encoded as; "
            + f"the types are {', '.join(map(repr, types))}",
        ),
        (
            config.finetune == "full" or config.rollout_backend == "hf",
            "finetune",
            "finetune: lora needs rollout_backend: hf (the vLLM engine syncs full weights, not an adapter)",
        ),
        (
            config.init_adapter is None or config.finetune == "lora",
            "init_adapter",
            "init_adapter: starting from an adapter needs finetune: lora",
        ),
        (config.epochs >= 1 or config.max_steps > 0, "epochs", "epochs: set epochs >= 1 or max_steps > 0"),
        (
            config.warm_start_steps == 0 or config.contrastive_beta > 0,
            "warm_start_steps",
            "warm_start_steps: the warm start trains β · InfoNCE alone (K = 1 has no advantage); "
            + "it needs contrastive_beta > 0",
        ),
        (
            not graded
            or (config.batch_sampling == "by_source" and (config.contrastive_beta > 0 or _embedding_loss(config))),
            "train_data",
            "train_data: an 'sts' source (graded pairs) trains β · CoSENT on batches of its own: it needs "
            + f"batch_sampling: by_source and contrastive_beta > 0 (or algorithm: {embedding_loss_names()})",
        ),
        (
            config.temperature_positive > 0 or config.num_rollouts == 1,
            "temperature_positive",
            "temperature_positive: K > 1 positive rollouts need temperature_positive > 0, or every rollout is the same",
        ),
        (not config.push_to_hub or bool(config.hub_model_id), "hub_model_id", "push_to_hub needs hub_model_id"),
        *_embedding_loss_rules(config),
    ]


def _embedding_loss_rules(config: TrainConfig) -> list[tuple[bool, str, str]]:
    """The rules each algorithm's record sets: the prompt formats it trains, the one pass a step of an algorithm whose
    loss is on embeddings, and the other algorithms' keys it refuses."""
    record = ALGORITHMS[config.algorithm]
    formats = [name for name, other in ALGORITHMS.items() if config.prompt_format in other.prompt_formats]
    refused = refused_keys_set(config)
    return [
        (
            config.prompt_format in record.prompt_formats,
            "prompt_format",
            f"prompt_format: {config.prompt_format} is not a format algorithm {config.algorithm} trains; it needs "
            + f"algorithm: {' or '.join(formats)}",
        ),
        (
            config.instructions is None or "default" in config.instructions,
            "instructions",
            "instructions: a mapping of prompt type to instruction text with a 'default' entry",
        ),
        (
            not record.embedding_loss or (config.rollout_backend == "hf" and config.gradient_accumulation_steps == 1),
            "algorithm",
            f"algorithm: {config.algorithm} trains its embeddings with the HF model in one pass a step: it needs "
            + "rollout_backend: hf and gradient_accumulation_steps: 1",
        ),
        (
            not refused,
            "algorithm",
            f"algorithm: {config.algorithm} has no rollouts, rewards or policy term; these keys would be ignored: "
            + ", ".join(refused),
        ),
    ]


def _embedding_loss(config: TrainConfig) -> bool:
    return ALGORITHMS[config.algorithm].embedding_loss


def embedding_loss_names() -> str:
    """The algorithms whose loss is on embeddings, as a message names them ("icr or grc")."""
    return " or ".join(name for name, record in ALGORITHMS.items() if record.embedding_loss)


def refused_keys_set(config: TrainConfig) -> list[str]:
    """The keys the run's algorithm refuses (its record's ``refused_keys``) set away from their defaults: refused
    rather than ignored."""
    defaults = {item.name: item.default for item in dataclasses.fields(TrainConfig)}
    return [name for name in ALGORITHMS[config.algorithm].refused_keys if getattr(config, name) != defaults[name]]


def _check_source(where: str, source: Any) -> None:
    from grace_training.data.examples import SOURCE_TYPES

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


def check_batches(config: TrainConfig, instances: int, world_size: int = 1) -> None:
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


def check_environment(config: TrainConfig) -> None:
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


if __name__ == "__main__":
    print(config_table())
