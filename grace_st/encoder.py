"""GenerativeEncoder: a sentence-transformers input module that writes a rationale, then
mean-pools its own hidden states over the text and the rationale (method.md §1, Eqs. 1–3).

The saved directory is both a sentence-transformers model and a plain causal-LM directory
(``config.json``, ``model.safetensors``, tokenizer files at the root), so
``AutoModelForCausalLM.from_pretrained(dir)`` still loads a model that generates. A model
trained as a LoRA adapter saves the adapter instead (PEFT's ``adapter_config.json`` and
``adapter_model.safetensors``, naming its base): see :mod:`grace_st.adapter`.
``modules.json`` names the installed package's class, ``grace_st.encoder.GenerativeEncoder``.

Why one file of ~690 lines: a sentence-transformers module is one class (settings, preprocess,
forward with one output builder, save/load), and its docstrings carry the user-facing contract.
What is not the module's own job has a file of its own: the model as it thinks and embeds, which
training's rollouts share (:mod:`grace_st.engine`), the method's decoding loop
(:mod:`grace_st.generation`) and its speed-ups (:mod:`grace_st.decoding`), the second pass for
vLLM's rationales (:mod:`grace_st.second_pass`), the rationale cache's storage
(:mod:`grace_st.cache`), the mteb name and revision (:mod:`grace_st.mteb_identity`),
adapters (:mod:`grace_st.adapter`), settings and their checks (:mod:`grace_st.settings`), prompts
(:mod:`grace_st.prompts`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import mteb_identity, quantization
from .adapter import adapter_base, copy_adapter, is_adapter_dir, is_peft_model, load_base_and_adapter, save_adapter
from .batch import RolloutRequest, left_pad, pad_rationales
from .cache import REQUIRED_SETTINGS, CacheEntry, CacheFile, is_deterministic
from .decoding import DecodeOptions
from .engine import ENGINES, RationaleEngine
from .prompts import (
    PromptTemplate,
    build_prompt_template,
    compose_instruction,
    text_problem,
    tokenize_texts,
)
from .settings import (
    DEFAULTS,
    SETTINGS,
    check_settings,
    default,
    for_prompt_type,
    plain,
    read_settings_file,
    settings_docstring,
)
from .weights import tensor_change_key, weights_fingerprint

try:  # sentence-transformers 6.x
    from sentence_transformers.base.modules import InputModule
except ImportError:  # sentence-transformers 5.x
    from sentence_transformers.models import InputModule


def _hub_kwargs(token, cache_folder, revision, local_files_only, trust_remote_code, subfolder) -> dict[str, Any]:
    kwargs = {
        "token": token,
        "cache_dir": cache_folder,
        "revision": revision,
        "local_files_only": local_files_only,
        "trust_remote_code": trust_remote_code,
    }
    if subfolder:
        kwargs["subfolder"] = subfolder
    return kwargs


def _model_and_tokenizer(
    model_name_or_path: str | None, model, tokenizer, merge_adapter: bool, model_kwargs, tokenizer_kwargs
):
    """The given causal LM and tokenizer, or both loaded from ``model_name_or_path`` (a base with its
    saved LoRA adapter, when the folder holds one)."""
    from transformers import AutoTokenizer

    from .loading import causal_lm_from_pretrained

    if (model is None) != (tokenizer is None):
        raise ValueError("Pass both `model` and `tokenizer`, or neither and a `model_name_or_path`.")
    if model is not None:
        return model, tokenizer
    if model_name_or_path is None:
        raise ValueError("GenerativeEncoder needs a `model_name_or_path`, or a `model` and a `tokenizer`.")
    model_kwargs = dict(model_kwargs or {})
    # grace-st's own load option, not transformers': applied once the weights (and adapter) are in
    scheme = model_kwargs.pop(quantization.LOAD_KEY, None)
    if is_adapter_dir(model_name_or_path):
        model = load_base_and_adapter(model_name_or_path, merge=merge_adapter, model_kwargs=model_kwargs)
    else:
        model = causal_lm_from_pretrained(model_name_or_path, **model_kwargs)
    if scheme is not None:
        quantization.quantize_weights(model, scheme)
    return model, AutoTokenizer.from_pretrained(model_name_or_path, **(tokenizer_kwargs or {}))


def _unreadable_safetensors(model_name_or_path: str | None) -> list[str]:
    """The ``*.safetensors`` files of a model directory (and of its adapter's base directory) whose
    header safetensors refuses: a truncated or corrupt file."""
    from safetensors import SafetensorError, safe_open

    folders = [model_name_or_path] if model_name_or_path and os.path.isdir(model_name_or_path) else []
    if folders and is_adapter_dir(model_name_or_path):
        with contextlib.suppress(ValueError):
            folders.append(adapter_base(model_name_or_path)[0])
    damaged = []
    for folder in filter(os.path.isdir, folders):
        for name in sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")):
            try:
                with safe_open(os.path.join(folder, name), framework="pt"):
                    pass
            except (SafetensorError, OSError):
                damaged.append(os.path.join(folder, name))
    return damaged


@contextlib.contextmanager
def _naming_damaged_weights(model_name_or_path: str | None) -> Iterator[None]:
    """safetensors' error for a truncated or corrupt weights file names no file ("Error while
    deserializing header: incomplete metadata, file not fully covered"): re-raised as a
    ``ValueError`` that names it, so the user knows which file to copy or download again."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as error:
        where = ", ".join(_unreadable_safetensors(model_name_or_path)) or f"a weights file of {model_name_or_path}"
        raise ValueError(
            f"{where}: a truncated or corrupt safetensors file ({error}); copy or download the model again"
        ) from error


# model_kwargs that load the weights in another form than saved (their fingerprint differs by design).
_CHANGES_WEIGHTS = frozenset(
    {"dtype", "torch_dtype", "quantization_config", "device_map", "load_in_8bit", "load_in_4bit", quantization.LOAD_KEY}
)


class GenerativeEncoder(InputModule):
    """Embeds a text with a causal LM: ``h = mean(π_θ(P(x) ⊕ r))`` with ``r ~ π_θ(· | P(x))``.

    Args:
        model_name_or_path: a causal LM with a chat template (local directory or Hub id).
{settings}
        model, tokenizer: an already loaded causal LM and tokenizer, instead of a path.
        model_kwargs, tokenizer_kwargs: passed to ``from_pretrained``.
    """

    config_file_name = "grace_config.json"
    config_keys = list(SETTINGS)  # every checked setting is saved, and nothing else
    forward_kwargs = {"task"}
    save_in_root = True
    # Prompt names the calling libraries use, and the prompt type each one means:
    # mteb and sentence-transformers say query/document, LlamaIndex says "text" for documents.
    prompt_names = {"query": "query", "document": "document", "text": "document", "passage": "document"}

    def __init__(
        self,
        model_name_or_path: str | None = None,
        *,
        method: str = DEFAULTS["method"],
        instructions: dict[str, str] | None = None,  # None: the default instructions
        max_rationale_tokens: int | dict[str, int] = DEFAULTS["max_rationale_tokens"],
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
    ) -> None:
        super().__init__()
        if isinstance(instructions, Mapping):
            instructions = {**default("instructions"), **instructions}
        settings = {
            "method": method,
            "instructions": default("instructions") if instructions is None else instructions,
            "max_rationale_tokens": max_rationale_tokens,
            "max_input_tokens": max_input_tokens,
            "do_sample": do_sample,
            "temperature": temperature,
            "top_p": top_p,
            "repetition_penalty": repetition_penalty,
            "seed": seed,
            "num_rationales": num_rationales,
            "hidden_layer": hidden_layer,
            "weights_revision": weights_revision,
            "merge_adapter": merge_adapter,
        }
        check_settings(settings)  # before the weights load: a bad value costs no time
        with _naming_damaged_weights(model_name_or_path):
            self.model, self.tokenizer = _model_and_tokenizer(
                model_name_or_path, model, tokenizer, merge_adapter, model_kwargs, tokenizer_kwargs
            )
        for name, value in plain(settings).items():
            setattr(self, name, value)
        # What evaluation libraries call this model when it has no Hub id (see describe_for_mteb).
        name = model_name_or_path or getattr(self.model, "name_or_path", "") or "grace-model"
        self.model_id = mteb_identity.model_id(name)
        self._described: tuple[str | None, str | None] = (None, None)
        self._rationale_cache: CacheFile | None = None
        self._fingerprint: tuple[tuple, str] | None = None  # (parameter versions, weights fingerprint)
        self._source_path = model_name_or_path if model_name_or_path and os.path.isdir(model_name_or_path) else None
        self._vllm = None
        self._weights_to_save: dict[str, Tensor] | None = None  # see saving_weights
        self._adapter_to_save: tuple[str, str] | None = None  # see saving_adapter
        # How rollouts feed the model (grace_st.decoding): speed only, so not a saved setting.
        self.decode_options = DecodeOptions()
        self._templates: dict[str, PromptTemplate] = {}
        # instruction text -> prompt type, for prompts that are our own instructions (see on_model_ready)
        self._instruction_prompts = {text: kind for kind, text in self.instructions.items()}
        self.check_settings()
        # Fail at construction, not at the first encode, when the template cannot be split.
        self.prompt_template(self.instructions["default"])

    # -- settings ---------------------------------------------------------------------------

    def check_settings(self) -> None:
        """Validate the run-time settings (:func:`grace_st.settings.check_settings`); called on
        construction, after load and before every batch, so a setting changed on the instance
        is checked before it is used."""
        values = {name: getattr(self, name) for name in SETTINGS}
        check_settings(values, num_layers=self.model.config.get_text_config().num_hidden_layers)
        for name, value in plain(values).items():
            if name != "instructions":
                setattr(self, name, value)

    @property
    def max_seq_length(self) -> int:
        """Prompt length limit in tokens (sentence-transformers' name for ``max_input_tokens``)."""
        return self.max_input_tokens

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        self.max_input_tokens = value

    @property
    def engine(self) -> RationaleEngine:
        """The model as it thinks and embeds: ``forward`` and training both go through it. The class is
        ``method``'s (:data:`grace_st.engine.ENGINES`: a rationale, or GIRCSE's soft tokens). A view over
        the current model, adapter, ``hidden_layer``, ``decode_options`` and backend (HF, or vLLM after
        :meth:`use_vllm`), built when asked."""
        return ENGINES[self.method](
            self.model, self.tokenizer, hidden_layer=self.hidden_layer, options=self.decode_options, generator=self._vllm
        )

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

    def prompt_template(self, instruction: str) -> PromptTemplate:
        if instruction not in self._templates:
            self._templates[instruction] = build_prompt_template(self.tokenizer, instruction)
        return self._templates[instruction]

    def _prompt_kind(self, prompt: str | None) -> str | None:
        """The prompt type a prompt stands for, when it is one of this module's instructions."""
        kind = {text: kind for kind, text in self.instructions.items()}.get(prompt or "")
        return kind or self._instruction_prompts.get(prompt or "")

    def instruction_for(self, task: str | None, prompt: str | None) -> str:
        """The system instruction for a call.

        A prompt that is one of this module's instructions (as :meth:`on_model_ready` puts them
        in the model's prompts) selects that prompt type's *current* instruction; any other
        prompt is appended to the instruction of ``task``.
        """
        kind = self._prompt_kind(prompt)
        if kind is not None:
            return self.instructions.get(kind, self.instructions["default"])
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
        return (
            features.get("rationale_budget", self.rationale_budget()),
            features.get("num_rationales", self.rationales_per_text()),
        )

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
        self.describe_for_mteb(model)

    def revision(self) -> str:
        """What mteb files results under besides the name (:func:`grace_st.mteb_identity.revision`)."""
        return mteb_identity.revision(self)

    def describe_for_mteb(self, model) -> None:
        """Name and revision in ``model``'s card data (:func:`grace_st.mteb_identity.describe_for_mteb`).
        Call again after changing settings at run time (``grace-st eval`` does)."""
        mteb_identity.describe_for_mteb(self, model)

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
        return {**state, "_vllm": None}

    def use_vllm(self, model_path: str | os.PathLike | None = None, **vllm_kwargs: Any) -> None:
        """Write rationales with vLLM (GPU, ``pip install "grace-st[vllm]"``) and pool them with one
        HF forward pass (:func:`grace_st.second_pass.pooled_embeddings`); :meth:`use_hf` switches back.
        Under greedy decoding the embeddings equal the HF backend's within
        floating-point tolerance. ``model_path`` defaults to the directory this module was
        loaded from; ``vllm_kwargs`` go to :class:`grace_st.vllm_backend.VLLMRationaleGenerator`
        (``dtype``, ``gpu_memory_utilization`` ...). Outputs carry no ``token_embeddings``.
        """
        from .vllm_backend import VLLMRationaleGenerator

        if self.method != "grace":
            raise ValueError(f"use_vllm writes rationales; method {self.method!r} feeds back soft tokens, which vLLM cannot")
        path = model_path or self._source_path
        if path is None:
            raise ValueError("use_vllm needs a model directory: save the model first, or pass model_path")
        self._vllm = VLLMRationaleGenerator(os.fspath(path), **vllm_kwargs)

    def use_hf(self) -> None:
        """Generate with the HF model again (the default one-pass backend)."""
        self._vllm = None

    def weights_key(self) -> str:
        """:func:`grace_st.weights.weights_fingerprint` of the policy, recomputed only when a
        parameter may have changed (:func:`grace_st.weights.tensor_change_key`)."""
        with torch.no_grad():
            versions = tuple(tensor_change_key(p) for p in self.model.parameters())
        if self._fingerprint is None or self._fingerprint[0] != versions:
            self._fingerprint = (versions, weights_fingerprint(self.model))
        return self._fingerprint[1]

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
        as ``rationale_budget`` and ``num_rationales``.
        """
        self.check_settings()
        texts = list(inputs)
        rows, instruction_span = self.prompt_token_ids(texts, task=task, prompt=prompt)
        kind = self.prompt_type(task, prompt)
        instruction = self.instruction_for(task, prompt)
        cache_keys = None
        settings = self.generation_settings(kind)
        if self._rationale_cache is not None and is_deterministic(settings):
            cache_keys = CacheFile.keys(self.weights_key(), instruction, texts, rows, settings)
        repeats = settings["num_rationales"]
        rows = [row for row in rows for _ in range(repeats)]
        input_ids, attention_mask = left_pad(rows, self.pad_token_id)
        features = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "instruction_lengths": torch.full((len(rows),), instruction_span, dtype=torch.long),
            "rationale_budget": settings["max_rationale_tokens"],
            "num_rationales": repeats,
        }
        if self.do_sample and self.seed is not None:
            features["rationale_seeds"] = torch.tensor(
                [self._rationale_seed(instruction, text, k) for text in texts for k in range(repeats)],
                dtype=torch.long,
            )
        if cache_keys is not None:
            features["cache_keys"] = cache_keys
        return features

    def prompt_token_ids(
        self, texts: Sequence[str], task: str | None = None, prompt: str | None = None
    ) -> tuple[list[list[int]], int]:
        """P(x) for each text, unpadded: the chat template around the call's instruction and the
        text, cut to fit ``max_input_tokens``; and L_sys, the instruction span every row shares
        (Eq. 3 pools after it). What :meth:`preprocess` pads for ``encode``, and the prompts GRPO
        rollouts start from.
        """
        for index, text in enumerate(texts):
            problem = text_problem(text)
            if problem is not None:
                # ValueError, not TypeError: sentence-transformers 6 answers a TypeError from
                # preprocess by retrying with the prompt glued to each text, and that retry's
                # own error (str + list) would replace this one.
                raise ValueError(
                    f"GenerativeEncoder takes strings; item {index} of this batch (sorted by length) {problem}"
                )
        template = self.prompt_template(self.instruction_for(task, prompt))
        text_budget = self.max_input_tokens - len(template.prefix_ids) - len(template.suffix_ids)
        if text_budget < 0:
            raise ValueError(
                f"The instruction and chat template take {len(template.prefix_ids) + len(template.suffix_ids)} "
                f"tokens, more than max_input_tokens={self.max_input_tokens}"
            )
        rows = [template.build(ids[:text_budget]) for ids in tokenize_texts(self.tokenizer, list(texts))]
        return rows, template.instruction_span

    def tokenize(self, texts: list[str], **kwargs):
        """sentence-transformers 5.x entry point (6.x calls :meth:`preprocess`)."""
        return self.preprocess(texts, **kwargs)

    def _rationale_seed(self, instruction: str, text: str, index: int) -> int:
        key = f"{self.seed}\x00{index}\x00{instruction}\x00{text}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1

    def forward(self, features: dict[str, Tensor], task: str | None = None, **kwargs) -> dict[str, Tensor]:
        """Generate, pool (Eq. 3) and average over ``num_rationales``.

        Adds ``sentence_embedding`` (B, H), ``token_embeddings`` and ``attention_mask`` of the
        first rationale's ``P(x) ⊕ r``, ``rationale_token_ids`` (B, num_rationales, G; -1 pads),
        ``rationale_truncated`` (B, num_rationales) and ``rationale_budget`` (B,), the token
        limit each text's rationale had. With ``method="gircse"`` the "rationale" is each soft
        token's most probable token, and ``soft_token_ids`` / ``soft_token_probs`` (B, K, 5) hold
        each step's five most probable tokens (not for texts answered from the rationale cache).
        """
        if "cache_keys" in features:
            return self._embed_through_cache(features)
        return self.embed(features)

    def _embed_through_cache(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        """:meth:`embed` for the texts the rationale cache lacks, stored; every text answered from its entry
        (hits carry no per-token states). From several threads at once: reads and writes take turns on the
        one connection, generation does not wait for them; two threads missing the same text both generate
        it (the same entry, stored twice)."""
        keys = features["cache_keys"]
        budget, repeats = self.batch_plan(features)
        found = self._rationale_cache.lookup(keys)
        missing = [i for i, key in enumerate(keys) if key not in found]
        if missing:
            rows = torch.tensor(
                [i * repeats + k for i in missing for k in range(repeats)], device=features["input_ids"].device
            )
            names = ("input_ids", "attention_mask", "instruction_lengths", "rationale_seeds")
            subset = {name: features[name][rows] for name in names if name in features}
            subset.update(rationale_budget=budget, num_rationales=repeats)
            fresh = dict(zip((keys[i] for i in missing), self.cache_entries(self.embed(subset))))
            self._rationale_cache.store(fresh)
            found.update(fresh)
        entries = [found[key] for key in keys]
        return self.outputs(
            features,
            torch.from_numpy(np.stack([entry.embedding for entry in entries])),
            pad_rationales([entry.rationale_ids for entry in entries], repeats),
            torch.tensor([entry.truncated for entry in entries]),
        )

    @staticmethod
    def cache_entries(out: dict[str, Tensor]) -> list[CacheEntry]:
        """Each text of :meth:`embed`'s output as the rationale cache stores it."""
        return [
            CacheEntry(
                rationale_ids=[[t for t in row if t >= 0] for row in out["rationale_token_ids"][j].tolist()],
                truncated=[bool(t) for t in out["rationale_truncated"][j].tolist()],
                embedding=out["sentence_embedding"][j].float().cpu().numpy(),
            )
            for j in range(len(out["sentence_embedding"]))
        ]

    def embed(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        """Rationales and pooled embeddings for preprocessed prompts, through :attr:`engine` (the HF
        one-pass rollout, or vLLM generation and an HF pass when :meth:`use_vllm` is on): Eq. 3 on
        each rollout, then the mean over a text's ``num_rationales`` rollouts."""
        repeats = self.batch_plan(features)[1]
        engine, request = self.engine, self.rollout_request(features)
        thoughts = engine.generate(request)
        pooled = engine.embed(request, thoughts)
        rationales = thoughts.rationales
        grouped = [rationales.rationale_ids[i : i + repeats] for i in range(0, len(rationales.rationale_ids), repeats)]
        states = thoughts.single_pass()  # the HF rollout's per-token states (first rationale of each text)
        per_token = {} if states is None else {
            "attention_mask": states.attention_mask[::repeats],
            "token_embeddings": states.token_embeddings[::repeats],
        }
        soft = getattr(states, "soft", None)
        if soft is not None:  # GIRCSE's readable trace: each step's most probable tokens (explain)
            per_token.update(soft_token_ids=soft.top_ids, soft_token_probs=soft.top_probs)
        return self.outputs(
            features,
            pooled.view(len(grouped), repeats, -1).mean(1),
            pad_rationales(grouped, repeats),
            torch.tensor(rationales.truncated, dtype=torch.bool).view(len(grouped), repeats),
            **per_token,
        )

    def rollout_request(self, features: dict[str, Tensor]) -> RolloutRequest:
        """The engine's request for preprocessed prompts: each row unpadded, its L_sys, the sampling
        settings (temperature 0 unless ``do_sample``, the repetition penalty) and seeds, and the batch's budget."""
        prompts = [row[mask.bool()].tolist() for row, mask in zip(features["input_ids"], features["attention_mask"])]
        return RolloutRequest(
            prompts,
            features["instruction_lengths"].tolist(),
            temperatures=self.temperature if self.do_sample else 0.0,
            top_p=self.top_p,
            max_new_tokens=self.batch_plan(features)[0],
            seeds=features["rationale_seeds"].tolist() if "rationale_seeds" in features else None,
            repetition_penalty=self.repetition_penalty,
        )

    def outputs(
        self,
        features: dict[str, Tensor],
        embeddings: Tensor,
        rationale_token_ids: Tensor,
        truncated: Tensor,
        **states: Tensor,
    ) -> dict[str, Tensor]:
        """What :meth:`forward` returns, however the rationales came (one-pass rollout, vLLM, the
        rationale cache): per text, its embedding (B, H), rationales (B, num_rationales, G),
        truncation flags and budget; ``states`` adds the first rollout's token states."""
        budget, repeats = self.batch_plan(features)
        device = features["input_ids"].device
        batch = embeddings.shape[0]
        return {
            "input_ids": features["input_ids"][::repeats],
            **states,
            "sentence_embedding": embeddings.to(device),
            "rationale_token_ids": rationale_token_ids.to(device),
            "rationale_truncated": truncated.to(device),
            "rationale_budget": torch.full((batch,), budget, dtype=torch.long, device=device),
        }

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
        (:func:`grace_st.adapter.merged_adapter`): a directory of megabytes that loads back to
        the weights in memory, written without constructing a ``PeftModel``."""
        self._adapter_to_save = (str(adapter_dir), str(base))
        try:
            yield self
        finally:
            self._adapter_to_save = None

    def save(self, output_path: str, *args, safe_serialization: bool = True, **kwargs) -> None:
        if not safe_serialization:
            raise ValueError("GenerativeEncoder saves safetensors only (safe_serialization=True)")
        if quantization.quantization_scheme(self.model) is not None:
            raise ValueError(
                "this model was loaded with weight_quantization: its int8 weights are a load-time form of the "
                "saved float weights. Save the model loaded without it (quantize again at load)"
            )
        given = self._weights_to_save
        self.weights_revision = (weights_fingerprint(self.model, given) if given is not None else self.weights_key())[:16]
        if self._adapter_to_save is not None:
            adapter_dir, base = self._adapter_to_save
            copy_adapter(adapter_dir, output_path, base)
        elif is_peft_model(self.model):
            save_adapter(self.model, output_path, state_dict=self._weights_to_save)
        else:
            self.model.save_pretrained(output_path, state_dict=self._weights_to_save)
        self.tokenizer.save_pretrained(output_path)
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
        """The saved settings, checked (:func:`grace_st.settings.read_settings_file`).

        Unlike other sentence-transformers modules, a missing file is an error: the class
        defaults (a 256-token rationale, a 1024-token prompt) are not what the model was
        saved with, and embedding with them would give other vectors without a word.
        """
        from sentence_transformers.util import load_file_path

        name = config_filename or cls.config_file_name
        path = load_file_path(
            model_name_or_path,
            name,
            subfolder=subfolder,
            token=token,
            cache_folder=cache_folder,
            revision=revision,
            local_files_only=local_files_only,
        )
        if path is None:
            where = os.path.join(model_name_or_path, subfolder) if subfolder else model_name_or_path
            raise FileNotFoundError(
                f"{where}: no {name}. modules.json names a GenerativeEncoder, but the settings it was saved "
                "with are missing; copy the whole model directory (or download it again), or build a GRACE "
                "model from a causal LM with grace_st.from_causal_lm / `grace-st build`"
            )
        return read_settings_file(path)

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
        from .adapter import ADAPTER_WEIGHTS
        from .hub import hub_snapshot, is_repo_id, snapshot_repo

        if not os.path.isdir(model_name_or_path) and is_repo_id(model_name_or_path):
            # A Hub id (sentence-transformers 5.x and 6.x both pass the id, not the snapshot path):
            # work from its snapshot in the Hugging Face cache, so the model is named by repository
            # and commit, an adapter is seen as one, and a snapshot missing offline says what to
            # download. The snapshot is the revision; an adapter's base has its own.
            inside = (lambda name: f"{subfolder}/{name}") if subfolder else (lambda name: name)
            weights = ("model.safetensors", "model.safetensors.index.json", ADAPTER_WEIGHTS)
            model_name_or_path = hub_snapshot(
                model_name_or_path,
                revision,
                cache_dir=cache_folder,
                token=token,
                local_files_only=local_files_only,
                needs=(inside(cls.config_file_name), tuple(inside(name) for name in weights)),
            )
            revision = None
        config = cls.load_config(
            model_name_or_path,
            subfolder=subfolder,
            token=token,
            cache_folder=cache_folder,
            revision=revision,
            local_files_only=local_files_only,
        )
        # sentence-transformers 6 passes trust_remote_code=True for importing this class at all; it
        # is not a wish to run the base's own code (grace_st.loading). model_kwargs says that.
        trusted = bool((model_kwargs or {}).get("trust_remote_code", False))
        hub = _hub_kwargs(token, cache_folder, revision, local_files_only, trusted, subfolder)
        encoder = cls(
            model_name_or_path,
            **config,
            model_kwargs={**hub, **(config_kwargs or {}), **(model_kwargs or {})},
            tokenizer_kwargs={**hub, **(tokenizer_kwargs or {}), **(processor_kwargs or {})},
        )
        if not (config_kwargs or set(model_kwargs or {}) & _CHANGES_WEIGHTS) and not is_adapter_dir(model_name_or_path):
            encoder._check_weights_revision(model_name_or_path)
        if snapshot_repo(model_name_or_path) is not None:  # settings as saved: the commit alone names them
            encoder._snapshot_revision = encoder.revision()
        return encoder

    def _check_weights_revision(self, path: str) -> None:
        """The weights (and config) loaded are the ones :meth:`save` fingerprinted: a config.json or
        model.safetensors swapped or edited since would otherwise give other embeddings under the
        saved name, cache keys and mteb revision. One fingerprint pass (0.3 s a 135M model), which
        the rationale cache and mteb reuse. Not for adapters (saved unmerged, loaded merged) nor
        for loads that convert the weights (``_CHANGES_WEIGHTS``)."""
        if self.weights_revision is None:
            return
        found = self.weights_key()[:16]
        if found != self.weights_revision:
            raise ValueError(
                f"{path}: the weights and config.json loaded are not the ones {self.config_file_name} was saved with "
                f"(weights_revision {self.weights_revision}, found {found}): a file was replaced or edited after "
                "saving. Restore it, or save the model again (GenerativeEncoder.save) to accept these weights."
            )

    def __repr__(self) -> str:
        return f"GenerativeEncoder({self.get_config_dict()}, model={type(self.model).__name__})"


# The settings' part of the docstring comes from their table, as their defaults do.
GenerativeEncoder.__doc__ = GenerativeEncoder.__doc__.replace("{settings}", settings_docstring())
