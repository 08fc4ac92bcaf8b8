"""The file work of saving and loading a GRACE model, on plain values (a model, a tokenizer, a path, a state dict).

:func:`save_model` writes the causal LM's weights (or its LoRA adapter) and the tokenizer at the root of the model
directory; :func:`read_config` reads the settings (``grace_config.json``) back, :func:`local_snapshot` finds a Hub
id's files, :func:`model_and_tokenizer` loads the LM, and :func:`check_weights_revision` checks that the weights are
the ones the settings were saved with (``weights_revision``). ``GenerativeEncoder.save``, ``load`` and
``load_config``, which sentence-transformers calls, are thin methods over these.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

from torch import Tensor

from grace_st.files.adapter import (
    ADAPTER_WEIGHTS,
    adapter_base,
    copy_adapter,
    is_adapter_dir,
    is_peft_model,
    load_base_and_adapter,
    record_learned_state,
    save_adapter,
)
from grace_st.runtime.cpu import quantization
from grace_st.settings import read_settings_file

# model_kwargs that load the weights in another form than saved (their fingerprint differs by design).
CHANGES_WEIGHTS = frozenset(
    {"dtype", "torch_dtype", "quantization_config", "device_map", "load_in_8bit", "load_in_4bit", quantization.LOAD_KEY}
)


def hub_kwargs(token, cache_folder, revision, local_files_only, trust_remote_code, subfolder) -> dict[str, Any]:
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


def model_and_tokenizer(
    model_name_or_path: str | None, model, tokenizer, merge_adapter: bool, model_kwargs, tokenizer_kwargs
):
    """The given causal LM and tokenizer, or both loaded from ``model_name_or_path`` (a base with its
    saved LoRA adapter, when the folder holds one); a damaged weights file is named
    (:func:`naming_damaged_weights`)."""
    from transformers import AutoTokenizer

    from grace_st.files.loading import causal_lm_from_pretrained

    with naming_damaged_weights(model_name_or_path):
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
        return model, AutoTokenizer.from_pretrained(tokenizer_source(model_name_or_path), **(tokenizer_kwargs or {}))


TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")


def tokenizer_source(model_name_or_path: str) -> str:
    """Where the tokenizer is: the model's folder, or for an adapter saved without one (the layout PEFT's
    ``save_pretrained`` writes, e.g. GIRCSE's released adapters) the base it names."""
    if is_adapter_dir(model_name_or_path) and not any(
        os.path.isfile(os.path.join(model_name_or_path, name)) for name in TOKENIZER_FILES
    ):
        return adapter_base(model_name_or_path)[0]
    return model_name_or_path


def unreadable_safetensors(model_name_or_path: str | None) -> list[str]:
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
def naming_damaged_weights(model_name_or_path: str | None) -> Iterator[None]:
    """safetensors' error for a truncated or corrupt weights file names no file ("Error while
    deserializing header: incomplete metadata, file not fully covered"): re-raised as a
    ``ValueError`` that names it, so the user knows which file to copy or download again."""
    from safetensors import SafetensorError

    try:
        yield
    except SafetensorError as error:
        where = ", ".join(unreadable_safetensors(model_name_or_path)) or f"a weights file of {model_name_or_path}"
        raise ValueError(
            f"{where}: a truncated or corrupt safetensors file ({error}); copy or download the model again"
        ) from error


def save_model(
    path: str,
    model,
    tokenizer,
    *,
    state_dict: dict[str, Tensor] | None = None,
    adapter: tuple[str, str] | None = None,
    learned_states: Sequence[tuple[Any, Any]] = (),
) -> None:
    """Write a causal LM and its tokenizer at the root of ``path``: the LoRA adapter ``adapter`` names
    (``(adapter_dir, base)``, copied), a PEFT model's adapter, or the weights (``state_dict`` in place of the
    ones in memory when given); a method's learned state beside them (``learned_states``: (its
:class:`~grace_st.methods.base.LearnedState`, the module) pairs, e.g. GRC's latents). An adapter folder records its files
    (:func:`grace_st.files.adapter.record_learned_state`). Weights quantized at load are refused."""
    if quantization.quantization_scheme(model) is not None:
        raise ValueError(
            "this model was loaded with weight_quantization: its int8 weights are a load-time form of the "
            "saved float weights. Save the model loaded without it (quantize again at load)"
        )
    if adapter is not None:
        adapter_dir, base = adapter
        copy_adapter(adapter_dir, path, base)
    elif is_peft_model(model):
        save_adapter(model, path, state_dict=state_dict)
    else:
        model.save_pretrained(path, state_dict=state_dict)
    for kind, state in learned_states:  # a method's learned state (GRC's latents), beside the weights or the adapter
        kind.save(state, path)
    if is_adapter_dir(path):  # weights_revision is not checked for adapters: their files are
        record_learned_state(path)
    tokenizer.save_pretrained(path)


def read_config(
    model_name_or_path: str,
    name: str,
    subfolder: str = "",
    token: bool | str | None = None,
    cache_folder: str | None = None,
    revision: str | None = None,
    local_files_only: bool = False,
) -> dict[str, Any]:
    """The settings file ``name`` of a model directory or Hub id, checked
    (:func:`grace_st.settings.read_settings_file`).

    Unlike other sentence-transformers modules, a missing file is an error: the class
    defaults (a 256-token rationale, a 1024-token prompt) are not what the model was
    saved with, and embedding with them would give other vectors without a word.
    """
    from sentence_transformers.util import load_file_path

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


def local_snapshot(
    model_name_or_path: str,
    subfolder: str,
    config_file_name: str,
    token: bool | str | None = None,
    cache_folder: str | None = None,
    revision: str | None = None,
    local_files_only: bool = False,
) -> tuple[str, str | None]:
    """Where a model loads from, and the revision left to ask for there: a directory as it is; a Hub id
    (sentence-transformers 5.x and 6.x both pass the id, not the snapshot path) as its snapshot in the Hugging
    Face cache, so the model is named by repository and commit, an adapter is seen as one, and a snapshot
    missing offline says what to download. The snapshot is the revision; an adapter's base has its own."""
    from grace_st.files.hub import hub_snapshot, is_repo_id

    if os.path.isdir(model_name_or_path) or not is_repo_id(model_name_or_path):
        return model_name_or_path, revision
    inside = (lambda name: f"{subfolder}/{name}") if subfolder else (lambda name: name)
    weights = ("model.safetensors", "model.safetensors.index.json", ADAPTER_WEIGHTS)
    path = hub_snapshot(
        model_name_or_path,
        revision,
        cache_dir=cache_folder,
        token=token,
        local_files_only=local_files_only,
        needs=(inside(config_file_name), tuple(inside(name) for name in weights)),
    )
    return path, None


def loading_kwargs(
    subfolder: str = "",
    token: bool | str | None = None,
    cache_folder: str | None = None,
    revision: str | None = None,
    local_files_only: bool = False,
    model: dict[str, Any] | None = None,
    processor: dict[str, Any] | None = None,
    tokenizer: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``from_pretrained``'s keywords for the model and for the tokenizer: where to read (the Hub's), then
    sentence-transformers' ``config_kwargs`` / ``model_kwargs`` and ``tokenizer_kwargs`` / ``processor_kwargs``."""
    # sentence-transformers 6 passes trust_remote_code=True for importing this class at all; it
    # is not a wish to run the base's own code (grace_st.files.loading). model_kwargs says that.
    trusted = bool((model or {}).get("trust_remote_code", False))
    hub = hub_kwargs(token, cache_folder, revision, local_files_only, trusted, subfolder)
    return {**hub, **(config or {}), **(model or {})}, {**hub, **(tokenizer or {}), **(processor or {})}


def loads_as_saved(path: str, model_kwargs: dict[str, Any] | None, config_kwargs: dict[str, Any] | None) -> bool:
    """Whether the weights load as they were fingerprinted: not an adapter (saved unmerged, loaded merged: its
    files are checked, :func:`grace_st.files.adapter.check_learned_state`) and no load option that converts them
    (:data:`CHANGES_WEIGHTS`)."""
    return not (config_kwargs or set(model_kwargs or {}) & CHANGES_WEIGHTS) and not is_adapter_dir(path)


def check_weights_revision(path: str, config_file_name: str, saved: str, found: str) -> None:
    """The weights (and config) loaded, fingerprinted as ``found``, are the ones saved as ``saved``
    (``weights_revision``): a config.json or model.safetensors swapped or edited since would otherwise give
    other embeddings under the saved name, cache keys and mteb revision. One fingerprint pass (0.3 s a 135M
    model), which the rationale cache and mteb reuse."""
    if found != saved:
        raise ValueError(
            f"{path}: the weights and config.json loaded are not the ones {config_file_name} was saved "
            f"with (weights_revision {saved}, found {found}): a file was replaced or edited "
            "after saving. Restore it, or save the model again (GenerativeEncoder.save) to accept these weights."
        )
