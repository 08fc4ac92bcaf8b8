"""GenerativeEncoder: a sentence-transformers input module that writes a rationale, then
mean-pools its own hidden states over the text and the rationale (method.md §1, Eqs. 1–3).

The saved directory is both a sentence-transformers model and a plain causal-LM directory
(``config.json``, ``model.safetensors``, tokenizer files at the root), so
``AutoModelForCausalLM.from_pretrained(dir)`` still loads a model that generates. A model
trained as a LoRA adapter saves the adapter instead (PEFT's ``adapter_config.json`` and
``adapter_model.safetensors``, naming its base): see :mod:`grace_st.files.adapter`.
``modules.json`` names the installed package's class, ``grace_st.encoder.GenerativeEncoder``.

The class holds the settings, which instruction, rationale budget and count a call gets, and the steps
of ``preprocess``, ``forward``, ``save`` and ``load``. What those steps carry has files of its own: the encode
data path, from the batch ``preprocess`` builds to what ``forward`` returns, from rollouts or the rationale cache
(:mod:`grace_st.encoding`), and the file work of saving and loading (:mod:`grace_st.files.model_files`).
Files of their own also hold the model as it thinks and embeds, which training's rollouts share
(:mod:`grace_st.methods`), the method's decoding loop (:mod:`grace_st.runtime.generation`) and its speed-ups
(:mod:`grace_st.runtime.decoding`), the second pass for vLLM's rationales (:mod:`grace_st.runtime.second_pass`),
the rationale cache's storage (:mod:`grace_st.cache`), the mteb name and revision
(:mod:`grace_st.files.mteb_identity`), adapters (:mod:`grace_st.files.adapter`), settings and their checks
(:mod:`grace_st.settings`), prompts (:mod:`grace_st.prompts`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from grace_st import encoding
from grace_st.cache import REQUIRED_SETTINGS, CacheFile, is_deterministic
from grace_st.encoding import EncodeBatch, Plan, Sampling, TextResult, cached, per_text, to_features
from grace_st.files import model_files, mteb_identity
from grace_st.files.adapter import check_learned_state
from grace_st.files.hub import snapshot_repo
from grace_st.methods import RationaleEngine
from grace_st.methods.base import LearnedState, Method
from grace_st.methods.registry import learned_state_kinds, method_record, on_change
from grace_st.prompts import (
    InstructTemplate,
    PromptTemplate,
    build_template,
    compose_instruction,
)
from grace_st.runtime.batch import RolloutRequest
from grace_st.runtime.decoding import DecodeOptions
from grace_st.runtime.weights import tensor_change_key, weights_fingerprint
from grace_st.settings import (
    DEFAULTS,
    SETTING_NAMES,
    SETTINGS,
    check_settings,
    default,
    default_budget,
    for_prompt_type,
    overridden,
    plain,
    settings_docstring,
)

try:  # sentence-transformers 6.x
    from sentence_transformers.base.modules import InputModule
except ImportError:  # sentence-transformers 5.x
    from sentence_transformers.models import InputModule


def _with_default_instructions(instructions: Any) -> Any:
    """None: the default instructions; a mapping: the defaults with its own on top; anything else as given,
    for :func:`~grace_st.settings.check_settings` to refuse."""
    if isinstance(instructions, Mapping):
        return {**default("instructions"), **instructions}
    return default("instructions") if instructions is None else instructions


def _given_settings(given: Mapping[str, Any], method_settings: Mapping[str, Any]) -> dict[str, Any]:
    """The constructor's settings in the table's order: its parameters, and each method's own settings given by
    name (a method's setting not given: its default)."""
    unknown = sorted(set(method_settings) - set(SETTINGS))
    if unknown:
        raise TypeError(f"GenerativeEncoder got an unexpected keyword argument {unknown[0]!r}")
    given = {**given, **method_settings}
    return {name: given[name] if name in given else default(name) for name in SETTINGS}


class MethodParts:
    """What the encoder's ``method`` decides beside its settings (:attr:`method_record`): the engine it thinks and
    embeds through, built once per model, settings and learned state, and the learned state it holds beside the
    weights (GRC's latent tokens), prepared, loaded, saved and fingerprinted alike for every method."""

    def check_method_state(self, values: Mapping[str, Any]) -> None:
        """Refuse a learned state the settings in ``values`` no longer fit (GRC's latents cannot be resized)."""
        record = self.method_record
        state = getattr(self, record.state.attribute, None) if record.state is not None else None
        problem = record.state.problem(state, record.own_settings(values)) if state is not None else None
        if problem is not None:
            raise ValueError(problem)

    def prepare_method_state(self) -> None:
        """Give the method the learned state it reads (:attr:`Method.state <grace_st.methods.base.Method.state>`:
        GRC's latent tokens, the model's own or fresh ones); nothing for a method without one. Run at construction,
        after a settings override and when :attr:`engine` is built."""
        record = self.method_record
        if record.state is not None:
            held = getattr(self, record.state.attribute, None)
            own = record.own_settings({name: getattr(self, name) for name in record.settings})
            setattr(self, record.state.attribute, record.state.prepare(self.model, held, own))

    @property
    def method_record(self) -> Method:
        """The record of :attr:`method` (:data:`grace_st.methods.registry.METHODS`)."""
        return method_record(self.method)

    def learned_states(self) -> list[tuple[LearnedState, torch.nn.Module]]:
        """Every method's learned state this encoder holds (saved beside the weights, fingerprinted with them)."""
        held = [(kind, getattr(self, kind.attribute, None)) for kind in learned_state_kinds()]
        return [(kind, module) for kind, module in held if module is not None]

    def load_learned_states(self, folder: str | os.PathLike | None) -> None:
        """Hold each method's learned state as saved in ``folder`` (None where the folder has none, or no folder)."""
        for kind in learned_state_kinds():
            setattr(self, kind.attribute, kind.load(folder) if folder is not None else None)

    @property
    def engine(self) -> RationaleEngine:
        """The model as it thinks and embeds: ``forward`` and training both go through it. The class is
        ``method``'s (:attr:`method_record`: a rationale, GIRCSE's soft tokens, or GRC's latents). A view over
        the current model, adapter, ``hidden_layer``, ``decode_options``, the method's settings and learned state, and
        backend (HF, or vLLM after :meth:`use_vllm`): built once, and again when one of those is another."""
        objects, values = self._engine_key()
        cached = self._engine
        if cached is not None and cached[1] == values and all(a is b for a, b in zip(cached[0], objects)):
            return cached[2]
        self.prepare_method_state()
        objects, values = self._engine_key()
        record = self.method_record
        own = record.engine_options(dict(zip(record.settings, values[-1])), objects[-1])
        engine = record.engine(
            self.model, self.tokenizer, hidden_layer=self.hidden_layer, options=self.decode_options, generator=self._vllm,
            **own,
        )
        self._engine = (objects, values, engine)
        return engine

    def _engine_key(self) -> tuple[tuple, tuple]:
        """What :attr:`engine` is built from: the objects it holds (compared by identity) and the values it reads."""
        record = self.method_record
        state = getattr(self, record.state.attribute, None) if record.state is not None else None
        own = tuple(getattr(self, name) for name in record.settings)
        return (self.model, self.tokenizer, self._vllm, state), (self.method, self.hidden_layer, self.decode_options, own)

    def weights_key(self) -> str:
        """:func:`grace_st.runtime.weights.weights_fingerprint` of the policy (and of the methods' learned state: GRC's
        latent tokens), recomputed only when a parameter may have changed
        (:func:`grace_st.runtime.weights.tensor_change_key`)."""
        states = [module for _, module in self.learned_states()]
        extra = [p for module in states for p in module.parameters()]
        with torch.no_grad():
            versions = tuple(tensor_change_key(p) for p in (*self.model.parameters(), *extra))
        if self._fingerprint is None or self._fingerprint[0] != versions:
            key = weights_fingerprint(self.model)
            for module in states:  # a learned state decides the embedding as the LM's weights do
                if any(True for _ in module.parameters()):
                    key = hashlib.sha256(f"{key}/{weights_fingerprint(module)}".encode()).hexdigest()
            self._fingerprint = (versions, key)
        return self._fingerprint[1]


class GenerativeEncoder(MethodParts, InputModule):
    """Embeds a text with a causal LM: ``h = mean(π_θ(P(x) ⊕ r))`` with ``r ~ π_θ(· | P(x))``.

    Args:
        model_name_or_path: a causal LM with a chat template (local directory or Hub id).
{settings}
        model, tokenizer: an already loaded causal LM and tokenizer, instead of a path.
        model_kwargs, tokenizer_kwargs: passed to ``from_pretrained``.
    """

    config_file_name = "grace_config.json"
    config_keys = SETTING_NAMES  # every checked setting is saved, and nothing else (a method's own ones too)
    forward_kwargs = {"task"}
    save_in_root = True
    # Prompt names the calling libraries use, and the prompt type each one means:
    # mteb and sentence-transformers say query/document, LlamaIndex says "text" for documents.
    prompt_names = {"query": "query", "document": "document", "text": "document", "passage": "document"}
    # A Hub snapshot's revision under the settings it was saved with (set by load): settings changed since then
    # add their hash to the commit mteb files results under (describe_for_mteb).
    _saved_revision: str | None = None

    def __init__(
        self,
        model_name_or_path: str | None = None,
        *,
        method: str = DEFAULTS["method"],
        prompt_format: str = DEFAULTS["prompt_format"],
        instructions: dict[str, str] | None = None,  # None: the default instructions
        max_rationale_tokens: int | dict[str, int] | None = None,  # None: the method's (settings.default_budget)
        max_input_tokens: int = DEFAULTS["max_input_tokens"],
        do_sample: bool = DEFAULTS["do_sample"],
        temperature: float = DEFAULTS["temperature"],
        top_p: float = DEFAULTS["top_p"],
        repetition_penalty: float = DEFAULTS["repetition_penalty"],
        seed: int | None = DEFAULTS["seed"],
        num_rationales: int | dict[str, int] = DEFAULTS["num_rationales"],
        hidden_layer: int = DEFAULTS["hidden_layer"],
        weights_revision: str | None = DEFAULTS["weights_revision"],
        merge_adapter: bool = DEFAULTS["merge_adapter"],
        model=None,
        tokenizer=None,
        model_kwargs: dict[str, Any] | None = None,
        tokenizer_kwargs: dict[str, Any] | None = None,
        **method_settings: Any,  # each method's own settings (GRC's num_latent_tokens ...), by name
    ) -> None:
        super().__init__()
        settings = _given_settings(locals(), method_settings)
        settings["instructions"] = _with_default_instructions(instructions)
        if max_rationale_tokens is None:
            settings["max_rationale_tokens"] = default_budget(method)
        check_settings(settings)  # before the weights load: a bad value costs no time
        self.model, self.tokenizer = model_files.model_and_tokenizer(
            model_name_or_path, model, tokenizer, merge_adapter, model_kwargs, tokenizer_kwargs
        )
        for name, value in plain(settings).items():
            setattr(self, name, value)
        self._source_path = model_name_or_path if model_name_or_path and os.path.isdir(model_name_or_path) else None
        self.load_learned_states(self._source_path)  # a method's, saved beside the weights (GRC's latents), or None
        name = model_name_or_path or getattr(self.model, "name_or_path", "") or "grace-model"
        self.model_id = mteb_identity.model_id(name)  # the name evaluation libraries file it under (describe_for_mteb)
        self._described: tuple[str | None, str | None] = (None, None)
        self._rationale_cache: CacheFile | None = None
        self._fingerprint: tuple[tuple, str] | None = None  # (parameter versions, weights fingerprint)
        self._vllm = None
        self._engine: tuple[tuple, tuple, RationaleEngine] | None = None  # (objects, values, engine): see engine
        self._weights_to_save: dict[str, Tensor] | None = None  # see saving_weights
        self._adapter_to_save: tuple[str, str] | None = None  # see saving_adapter
        self._decode_options = DecodeOptions()  # how rollouts feed the model: speed only, so not a saved setting
        self._templates: dict[tuple[str, str], PromptTemplate | InstructTemplate] = {}
        # instruction text -> prompt type, for prompts that are our own instructions (see on_model_ready)
        self._instruction_prompts = {text: kind for kind, text in self.instructions.items()}
        # the SentenceTransformer's prompts (see on_model_ready): where a task's own instruction is found
        self._owner: weakref.ref | None = None
        self._owner_prompts: Mapping[str, str | None] = {}
        self.check_settings()
        self.prepare_method_state()
        # Fail at construction, not at the first encode, when the template cannot be split.
        self.prompt_template(self.instructions["default"])

    # -- settings ---------------------------------------------------------------------------

    def check_settings(self) -> None:
        """Validate the run-time settings (:func:`grace_st.settings.check_settings`), and the method's learned state
        against them (GRC's latents cannot be resized); called on construction, after load and before every batch,
        so a setting changed on the instance is checked before it is used. Checks only: the state a method reads is
        made by :meth:`prepare_method_state`."""
        values = {name: getattr(self, name) for name in SETTINGS}
        check_settings(values, num_layers=self.model.config.get_text_config().num_hidden_layers)
        for name, value in plain(values).items():
            if name != "instructions":
                setattr(self, name, value)
        self.check_method_state(values)

    def override_settings(self, overrides: Mapping[str, Any]) -> None:
        """Settings given on top of this module's (:func:`grace_st.settings.overridden`: types a per-prompt-type
        value does not name keep theirs), then checked."""
        current = {name: getattr(self, name) for name in overrides}
        for name, value in overridden(current, overrides).items():
            if name == "instructions":
                self.instructions.update(value)  # in place: the model's prompts read this mapping
            else:
                setattr(self, name, value)
        self.check_settings()
        self.prepare_method_state()

    @property
    def decode_options(self) -> DecodeOptions:
        """How rollouts feed the model (:class:`~grace_st.runtime.decoding.DecodeOptions`: speed only, not a saved setting).
        With ``merge_adapter`` false a LoRA adapter stays apart here too: its layers run as PEFT runs them, base and
        adapter products each on its own packed weight, never on a merged one (``merge_adapters`` off, whatever
        was set); the native step, which only runs merged weights, is then left out for such a model."""
        options = self._decode_options
        if self.merge_adapter or not options.merge_adapters:
            return options
        return dataclasses.replace(options, merge_adapters=False)

    @decode_options.setter
    def decode_options(self, options: DecodeOptions) -> None:
        self._decode_options = options

    @property
    def max_seq_length(self) -> int:
        """Prompt length limit in tokens (sentence-transformers' name for ``max_input_tokens``)."""
        return self.max_input_tokens

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        self.max_input_tokens = value

    @property
    def eos_token_ids(self) -> list[int]:
        return self.engine.eos_token_ids

    @property
    def pad_token_id(self) -> int:
        return self.engine.pad_token_id

    def get_embedding_dimension(self) -> int:
        return self.model.config.get_text_config().hidden_size

    def get_sentence_embedding_dimension(self) -> int:
        return self.get_embedding_dimension()

    def prompt_template(self, instruction: str) -> PromptTemplate | InstructTemplate:
        """How a text becomes a prompt under ``instruction``, in the ``prompt_format`` (:mod:`grace_st.prompts`)."""
        key = (self.prompt_format, instruction)
        if key not in self._templates:
            self._templates[key] = build_template(self.tokenizer, self.prompt_format, instruction)
        return self._templates[key]

    def _prompt_kind(self, prompt: str | None) -> str | None:
        """The prompt type a prompt stands for, when it is one of this module's instructions. No prompt (None or
        empty) stands for none: an empty instruction (a corpus embedded bare) must not claim every call made
        without a prompt."""
        if not prompt:
            return None
        kind = {text: kind for kind, text in self.instructions.items()}.get(prompt)
        return kind or self._instruction_prompts.get(prompt)

    def is_task_instruction(self, prompt: str | None) -> bool:
        """Whether ``prompt`` is a task's own instruction: a value the model's ``prompts`` hold under a name that is
        not a prompt type's (``query``, ``document``, ``text``, ``passage``): an mteb task name, ``"<task>-query"`` or
        ``"<task>-document"``, a task type such as ``"STS"``: the names mteb looks a task's prompt up by."""
        if not prompt:
            return False
        owner = self._owner() if self._owner is not None else None
        prompts = owner.prompts if owner is not None else self._owner_prompts
        return any(text == prompt and name not in self.prompt_names for name, text in (prompts or {}).items())

    def instruction_for(self, task: str | None, prompt: str | None) -> str:
        """The system instruction for a call.

        A prompt that is one of this module's instructions (as :meth:`on_model_ready` puts them
        in the model's prompts) selects that prompt type's *current* instruction; a task's own
        instruction (:meth:`is_task_instruction`: mteb passes the one ``model.prompts`` holds for the
        task) is the instruction, in place of the prompt type's; any other prompt is appended to the
        instruction of ``task``.
        """
        kind = self._prompt_kind(prompt)
        if kind is not None:
            return self.instructions.get(kind, self.instructions["default"])
        if self.is_task_instruction(prompt):
            return prompt
        base = self.instructions.get(task or "default", self.instructions["default"])
        return compose_instruction(base, prompt)

    def prompt_type(self, task: str | None, prompt: str | None) -> str:
        """The prompt type of a call (``"query"``, ``"document"``, ``"default"`` ...), resolved as
        :meth:`instruction_for` resolves the instruction: it picks the rationale budget too."""
        return self._prompt_kind(prompt) or task or "default"

    def rationale_budget(self, prompt_type: str = "default") -> int:
        """``max_rationale_tokens`` for texts of ``prompt_type``."""
        return for_prompt_type(self.max_rationale_tokens, prompt_type)

    def rationales_per_text(self, prompt_type: str = "default") -> int:
        """``num_rationales`` for texts of ``prompt_type``."""
        return for_prompt_type(self.num_rationales, prompt_type)

    def batch_plan(self, features: dict[str, Any]) -> tuple[int, int]:
        """(rationale budget, rationales per text) that :meth:`preprocess` chose for a batch;
        the default type's for features built elsewhere."""
        plan = self._batch(features).plan
        return plan.budget, plan.repeats

    def on_model_ready(self, model) -> None:
        """sentence-transformers 6.x hook, run once the model is built or loaded.

        Makes the query and document instructions the model's ``query`` / ``document`` prompts
        where those are unset or empty, so callers that only pass a prompt name still get them:
        LangChain (``prompt_name`` in its encode kwargs), LlamaIndex (which resets the "query"
        prompt to "" and asks for "text" for documents), mteb (``model.prompts``).
        """
        for name, kind in self.prompt_names.items():
            if (name in ("query", "document") or name in model.prompts) and not model.prompts.get(name):
                model.prompts[name] = self.instructions.get(kind, self.instructions["default"])
        self._instruction_prompts.update({text: kind for kind, text in self.instructions.items()})
        # Weakly (no cycle keeps a dropped model alive), and the prompts dict itself for a copy or a pickle,
        # which the reference does not survive: mteb may give the model a new prompts dict, the weak one follows it.
        self._owner, self._owner_prompts = weakref.ref(model), model.prompts
        self.describe_for_mteb(model)

    def revision(self) -> str:
        """What mteb files results under besides the name (:func:`grace_st.files.mteb_identity.revision`). Records
        the weights' fingerprint as ``weights_revision`` when none was saved, so the revision names the weights it
        was computed from."""
        if self.weights_revision is None:
            self.weights_revision = self.weights_key()[:16]
        return mteb_identity.revision(self.get_config_dict(), self.weights_revision)

    def describe_for_mteb(self, model) -> None:
        """Name and revision in ``model``'s card data (:func:`grace_st.files.mteb_identity.describe_for_mteb`).
        Call again after changing settings at run time (``grace-st eval`` does)."""
        self._described = mteb_identity.describe_for_mteb(
            model.model_card_data,
            self.model_id,
            self.revision,
            source=self._source_path,
            saved_revision=self._saved_revision,
            described=self._described,
        )

    # -- the rationale cache ------------------------------------------------------------------

    def set_rationale_cache(self, path: str | os.PathLike | None) -> None:
        """Use a persistent rationale cache (one SQLite file, :mod:`grace_st.cache`), or none.

        Used only under deterministic settings (greedy, or sampling with a seed). A hit skips
        generation and the forward pass: the rationale and the pooled vector come from the file.
        The key covers the weights, the prompt's token ids (tokenizer, chat template,
        instruction, text, truncation) and every generation setting. Hits have no per-token
        states, so with a cache the outputs carry no ``token_embeddings``. Not a saved setting:
        a cache file belongs to a machine, not to the model.
        """
        if self._rationale_cache is not None:
            self._rationale_cache.close()
            self._rationale_cache = None
        if path is not None:
            # a corrupt or foreign file is refused now, not at the first encode
            self._rationale_cache = CacheFile(path)

    @property
    def rationale_cache(self) -> CacheFile | None:
        """The rationale cache in use (:meth:`set_rationale_cache`), or None."""
        return self._rationale_cache

    def __getstate__(self) -> dict:
        # A GPU engine does not travel to another process (nor does a cache connection: CacheFile).
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        return {**state, "_vllm": None, "_owner": None, "_engine": None}

    def use_vllm(self, model_path: str | os.PathLike | None = None, **vllm_kwargs: Any) -> None:
        """Write rationales with vLLM (GPU, ``pip install "grace-st[vllm]"``) and pool them with one
        HF forward pass (:func:`grace_st.runtime.second_pass.pooled_embeddings`); :meth:`use_hf` switches back.
        Under greedy decoding the embeddings equal the HF backend's within
        floating-point tolerance. ``model_path`` defaults to the directory this module was
        loaded from; ``vllm_kwargs`` go to :class:`grace_st.runtime.vllm_backend.VLLMRationaleGenerator`
        (``dtype``, ``gpu_memory_utilization`` ...). Outputs carry no ``token_embeddings``.
        """
        from grace_st.runtime.vllm_backend import VLLMRationaleGenerator

        record = self.method_record
        if not record.vllm:
            raise ValueError(f"use_vllm writes rationales; method {record.name!r} {record.vllm_refusal}, which vLLM cannot")
        path = model_path or self._source_path
        if path is None:
            raise ValueError("use_vllm needs a model directory: save the model first, or pass model_path")
        self._vllm = VLLMRationaleGenerator(os.fspath(path), **vllm_kwargs)

    def use_hf(self) -> None:
        """Generate with the HF model again (the default one-pass backend)."""
        self._vllm = None

    def generation_settings(self, prompt_type: str = "default") -> dict[str, Any]:
        """Everything besides weights and prompt that decides a rationale and its embedding, for
        texts of ``prompt_type`` (the budget and count that type gets, so equal effective
        settings share rationale-cache entries)."""
        settings = {name: getattr(self, name) for name in REQUIRED_SETTINGS}
        settings["max_rationale_tokens"] = self.rationale_budget(prompt_type)
        settings["num_rationales"] = self.rationales_per_text(prompt_type)
        return settings

    # -- sentence-transformers interface -----------------------------------------------------

    def preprocess(self, inputs: Sequence[str], prompt: str | None = None, task: str | None = None, **kwargs):
        """Template and tokenize texts: left-padded prompts plus each one's L_sys.

        ``prompt`` (a sentence-transformers prompt, e.g. an mteb task instruction) joins the
        system instruction of ``task``; both are excluded from pooling. The call's prompt type
        (:meth:`prompt_type`) picks the rationale budget and count, carried to :meth:`forward`
        as ``rationale_budget`` and ``num_rationales`` (the features of an :class:`~grace_st.encoding.EncodeBatch`).
        """
        self.check_settings()
        texts = list(inputs)
        rows, instruction_span = self.prompt_token_ids(texts, task=task, prompt=prompt)
        instruction = self.instruction_for(task, prompt)
        settings = self.generation_settings(self.prompt_type(task, prompt))
        plan = Plan(settings["max_rationale_tokens"], settings["num_rationales"])
        # a method may read something else than the prompt at budget 0 (GRC: its latents)
        pools_prompt = plan.budget == 0 and self.method_record.pools_prompt_at_budget_zero
        encoding.check_prompts(rows, instruction_span, pools_prompt=pools_prompt)
        cache_keys = None
        if self._rationale_cache is not None and is_deterministic(settings):
            cache_keys = CacheFile.keys(self.weights_key(), instruction, texts, rows, settings)
        seeds = None
        if self.do_sample and self.seed is not None:
            seeds = encoding.rationale_seeds(self.seed, instruction, texts, plan.repeats)
        return EncodeBatch.build(rows, instruction_span, plan, self.pad_token_id, seeds, cache_keys).features()

    def prompt_token_ids(
        self, texts: Sequence[str], task: str | None = None, prompt: str | None = None
    ) -> tuple[list[list[int]], int]:
        """P(x) for each text, unpadded: the call's instruction and the text in the ``prompt_format`` (the chat
        template, or GIRCSE's reference string), cut to fit ``max_input_tokens``; and L_sys, the instruction span
        every row shares
        (Eq. 3 pools after it). What :meth:`preprocess` pads for ``encode``, and the prompts GRPO
        rollouts start from.
        """
        encoding.check_texts(texts)
        template = self.prompt_template(self.instruction_for(task, prompt))
        rows = template.rows(self.tokenizer, texts, self.max_input_tokens)
        encoding.check_prompts(rows, template.instruction_span)
        return rows, template.instruction_span

    def tokenize(self, texts: list[str], **kwargs):
        """sentence-transformers 5.x entry point (6.x calls :meth:`preprocess`)."""
        return self.preprocess(texts, **kwargs)

    def forward(self, features: dict[str, Tensor], task: str | None = None, **kwargs) -> dict[str, Tensor]:
        """Generate, pool (Eq. 3) and average over ``num_rationales``; through the rationale cache when the
        batch carries its keys (:func:`grace_st.encoding.cached`).

        Adds ``sentence_embedding`` (B, H), ``token_embeddings`` and ``attention_mask`` of the
        first rationale's ``P(x) ⊕ r``, ``rationale_token_ids`` (B, num_rationales, G; -1 pads),
        ``rationale_truncated`` (B, num_rationales) and ``rationale_budget`` (B,), the token
        limit each text's rationale had. With ``method="gircse"`` the "rationale" is each soft
        token's most probable token, and ``soft_token_ids`` / ``soft_token_probs`` (B, K, 5) hold
        each step's five most probable tokens (not for texts answered from the rationale cache).
        """
        batch = self._batch(features)
        if batch.cache_keys is None:
            return to_features(batch, *self._think(batch))
        return to_features(batch, cached(lambda part: self._think(part)[0], self._rationale_cache, batch))

    def _batch(self, features: dict[str, Any]) -> EncodeBatch:
        """The batch ``features`` carry; the default prompt type's plan for features built without one."""
        return EncodeBatch.from_features(features, Plan(self.rationale_budget(), self.rationales_per_text()))

    def _think(self, batch: EncodeBatch) -> tuple[list[TextResult], dict[str, Tensor]]:
        """Each text's result, through :attr:`engine` (the HF one-pass rollout, or vLLM generation and an HF
        pass when :meth:`use_vllm` is on): Eq. 3 on each rollout, then the mean over a text's rollouts; and the
        per-token states of each text's first rollout, when the engine kept them."""
        engine, request = self.engine, batch.request(self.sampling())
        thoughts = engine.generate(request)
        return per_text(thoughts, engine.embed(request, thoughts), batch.plan.repeats)

    def embed(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        """:meth:`forward` without the rationale cache."""
        batch = self._batch(features)
        return to_features(batch, *self._think(batch))

    def sampling(self) -> Sampling:
        """How rollouts are sampled: at ``temperature`` when ``do_sample`` (else greedy), ``top_p``, the
        repetition penalty."""
        return Sampling(self.temperature if self.do_sample else 0.0, self.top_p, self.repetition_penalty)

    def rollout_request(self, features: dict[str, Tensor]) -> RolloutRequest:
        """The engine's request for preprocessed prompts (:meth:`grace_st.encoding.EncodeBatch.request`)."""
        return self._batch(features).request(self.sampling())

    def decode_rationales(self, rationale_token_ids: Tensor) -> list[str]:
        """Text of each rationale exactly as pooled (special tokens kept, EOS not part of it)."""
        return [
            self.tokenizer.decode([t for t in row if t >= 0], skip_special_tokens=False)
            for row in rationale_token_ids.tolist()
        ]

    # -- persistence ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def saving_weights(self, state_dict: dict[str, Tensor]) -> Iterator[GenerativeEncoder]:
        """Within this block, :meth:`save` writes ``state_dict`` as the LM's weights instead of the
        ones in memory: the full weights gathered from a sharded (FSDP) policy, whose own
        parameters are shards. A context, not an argument, because ``SentenceTransformer.save``
        calls ``save`` with no way to pass one through."""
        self._weights_to_save = state_dict
        try:
            yield self
        finally:
            self._weights_to_save = None

    @contextlib.contextmanager
    def saving_adapter(self, adapter_dir: str | os.PathLike, base: str | os.PathLike) -> Iterator[GenerativeEncoder]:
        """Within this block, :meth:`save` writes the LoRA adapter in ``adapter_dir`` on ``base``
        instead of the LM's weights, which must be ``base`` with that adapter merged
        (:func:`grace_st.files.adapter.merged_adapter`): a directory of megabytes that loads back to
        the weights in memory, written without constructing a ``PeftModel``."""
        self._adapter_to_save = (str(adapter_dir), str(base))
        try:
            yield self
        finally:
            self._adapter_to_save = None

    def save(self, output_path: str, *args, safe_serialization: bool = True, **kwargs) -> None:
        """The LM's weights (the ones given to :meth:`saving_weights`, the adapter given to :meth:`saving_adapter`,
        a PEFT model's adapter, or the weights in memory), the method's learned state (GRC's latents), the tokenizer and the settings, with
        ``weights_revision`` set to the saved weights' fingerprint (:func:`grace_st.files.model_files.save_model`)."""
        if not safe_serialization:
            raise ValueError("GenerativeEncoder saves safetensors only (safe_serialization=True)")
        given = self._weights_to_save
        # fingerprinted before writing: saving may empty the given state dict (transformers does)
        fingerprint = weights_fingerprint(self.model, given) if given is not None else self.weights_key()
        model_files.save_model(
            output_path,
            self.model,
            self.tokenizer,
            state_dict=given,
            adapter=self._adapter_to_save,
            learned_states=list(self.learned_states()),
        )
        self.weights_revision = fingerprint[:16]
        self.save_config(output_path)

    @classmethod
    def load_config(
        cls,
        model_name_or_path: str,
        subfolder: str = "",
        config_filename: str | None = None,
        token: bool | str | None = None,
        cache_folder: str | None = None,
        revision: str | None = None,
        local_files_only: bool = False,
    ) -> dict[str, Any]:
        """The saved settings, checked (:func:`grace_st.files.model_files.read_config`): unlike other
        sentence-transformers modules, a missing file is an error."""
        name = config_filename or cls.config_file_name
        return model_files.read_config(
            model_name_or_path, name, subfolder, token, cache_folder, revision, local_files_only
        )

    @classmethod
    def load(
        cls,
        model_name_or_path: str,
        subfolder: str = "",
        token: bool | str | None = None,
        cache_folder: str | None = None,
        revision: str | None = None,
        local_files_only: bool = False,
        trust_remote_code: bool = False,
        model_kwargs: dict[str, Any] | None = None,
        processor_kwargs: dict[str, Any] | None = None,
        tokenizer_kwargs: dict[str, Any] | None = None,
        config_kwargs: dict[str, Any] | None = None,
        **kwargs,
    ) -> GenerativeEncoder:
        """An encoder built from its saved settings (:meth:`load_config`) and weights, from a directory or a Hub
        id (its snapshot: :func:`grace_st.files.model_files.local_snapshot`); weights loaded as saved are checked
        against ``weights_revision`` (:func:`grace_st.files.model_files.check_weights_revision`)."""
        where = {
            "token": token, "cache_folder": cache_folder, "revision": revision, "local_files_only": local_files_only
        }
        name = cls.config_file_name
        path, where["revision"] = model_files.local_snapshot(model_name_or_path, subfolder, name, **where)
        config = cls.load_config(path, subfolder=subfolder, **where)
        check_learned_state(path)  # an adapter folder's recorded files, before any weights load
        model_args, tokenizer_args = model_files.loading_kwargs(
            subfolder, **where, model=model_kwargs, processor=processor_kwargs, tokenizer=tokenizer_kwargs,
            config=config_kwargs,
        )
        encoder = cls(path, **config, model_kwargs=model_args, tokenizer_kwargs=tokenizer_args)
        if encoder.weights_revision is not None and model_files.loads_as_saved(path, model_kwargs, config_kwargs):
            found = encoder.weights_key()[:16]
            model_files.check_weights_revision(path, cls.config_file_name, encoder.weights_revision, found)
        if snapshot_repo(path) is not None:  # settings as saved: the commit alone names them
            encoder._saved_revision = encoder.revision()
        return encoder

    def __repr__(self) -> str:
        return f"GenerativeEncoder({self.get_config_dict()}, model={type(self.model).__name__})"


_DOC, _SIGNATURE = GenerativeEncoder.__doc__, inspect.signature(GenerativeEncoder.__init__)


def _describe_settings() -> None:
    """The constructor's docstring and signature name every setting, each method's own ones too, with the defaults of
    the settings table: rebuilt whenever a method is registered."""
    GenerativeEncoder.__doc__ = _DOC.replace("{settings}", settings_docstring())
    shared = list(_SIGNATURE.parameters.values())
    at = [p.name for p in shared].index("prompt_format") + 1
    own = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=DEFAULTS[name])
        for name in SETTINGS
        if name not in _SIGNATURE.parameters
    ]
    GenerativeEncoder.__init__.__signature__ = _SIGNATURE.replace(parameters=[*shared[:at], *own, *shared[at:]])


_describe_settings()
on_change(_describe_settings)
