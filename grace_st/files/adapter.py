"""GRACE models saved as a base model plus a LoRA adapter (PEFT's format, safetensors only).

A directory holding ``adapter_config.json`` and ``adapter_model.safetensors`` (what
``PeftModel.save_pretrained`` writes) is a GRACE model whose weights are its base's plus the
adapter. The base is named by PEFT's own field, ``base_model_name_or_path``: a directory
(absolute, or relative to the adapter's directory) or a Hub id. Such a directory also loads
with ``AutoModelForCausalLM.from_pretrained`` (transformers' PEFT integration), so it stays a
generative model.

The adapter is checked against the base before any weight is loaded: every LoRA matrix must
sit on a linear layer the base has, with matching sizes. A mismatch is refused with an error
that names the module and both shapes, never loaded half-way or silently ignored.

Merging (``merge_adapter``, the default) builds only PEFT's tuner for the adapter's type
(``LoraModel`` for LoRA), loads the adapter's weights into it and folds them into the base:
a merge needs nothing else. ``PeftModel`` wraps that same tuner, but its constructor reads the
base's ``is_gradient_checkpointing``, which transformers 5 deprecates with a FutureWarning on
every load; the merged weights are the same, bit for bit. ``merge_adapter: false`` asks for the
wrapper itself (``disable_adapter()``), so it is still a ``PeftModel``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from grace_st.files.hub import hub_snapshot, is_offline, is_repo_id

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The sha256 of an adapter folder's learned-state files as saved (learned_state_files), checked at load
LEARNED_STATE_RECORD = "learned_state.json"


def is_adapter_dir(path: str | os.PathLike | None) -> bool:
    return path is not None and os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def is_peft_model(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def adapter_base(adapter_dir: str | os.PathLike) -> tuple[str, str | None]:
    """The base model an adapter was trained on and its revision: ``base_model_name_or_path`` of
    its config (a relative directory resolved against the adapter's own directory) and PEFT's
    ``revision`` field (None: the base's default branch)."""
    config_path = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{config_path}: not a readable adapter config ({error})") from error
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: not a readable adapter config (not a JSON object)")
    base = config.get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{config_path}: names no base model (base_model_name_or_path is empty)")
    relative = Path(adapter_dir) / base
    if not Path(base).is_absolute() and relative.is_dir():
        base = str(relative.resolve())
    return base, config.get("revision")


def read_adapter_weights(adapter_dir: str | os.PathLike) -> dict[str, Any]:
    """The adapter's tensors, from safetensors only (a pickled ``adapter_model.bin`` is refused)."""
    from safetensors.torch import load_file

    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        found = ", ".join(sorted(p.name for p in Path(adapter_dir).glob("adapter_model*"))) or "none"
        raise FileNotFoundError(f"{path}: missing (adapter weights are read from safetensors only; found: {found})")
    try:
        return load_file(str(path))
    except Exception as error:  # safetensors raises its own error types for a truncated or foreign file
        raise ValueError(f"{path}: not a readable safetensors file ({error})") from error


def check_adapter_fits(base_model, weights: dict[str, Any], adapter_dir: str | os.PathLike) -> None:
    """Refuse an adapter whose LoRA matrices do not fit the base's linear layers.

    ``lora_A`` of a layer is (r, in_features) and ``lora_B`` (out_features, r); the layer is
    found by the key's module path with PEFT's ``base_model.model.`` prefix removed.
    """
    import torch

    modules = dict(base_model.named_modules())
    for key, tensor in weights.items():
        for part, side in ((".lora_A.", "in"), (".lora_B.", "out")):
            if part not in key:
                continue
            name = key.split(part)[0].removeprefix("base_model.model.")
            layer = modules.get(name)
            if layer is None:
                raise ValueError(
                    f"adapter {adapter_dir} does not fit its base ({type(base_model).__name__}): "
                    f"the base has no module {name!r}"
                )
            if not isinstance(layer, torch.nn.Linear):
                raise ValueError(f"adapter {adapter_dir}: {name!r} of the base is a {type(layer).__name__}, not Linear")
            expected = layer.in_features if side == "in" else layer.out_features
            actual = tensor.shape[1] if side == "in" else tensor.shape[0]
            if actual != expected:
                raise ValueError(
                    f"adapter {adapter_dir} does not fit its base: {key} has shape {tuple(tensor.shape)}, "
                    f"but {name} takes {layer.in_features} inputs and gives {layer.out_features} outputs"
                )


def load_base_and_adapter(adapter_dir: str | os.PathLike, *, merge: bool = True, model_kwargs: dict | None = None):
    """The base causal LM with the adapter applied: merged into the weights (``merge``: the
    base's speed, the packed CPU kernels) or kept as a ``PeftModel`` (``disable_adapter()``
    then gives exactly the base)."""
    from grace_st.files.loading import causal_lm_from_pretrained

    weights = read_adapter_weights(adapter_dir)
    # The revision asked of the adapter's repository is not the base's: the base has its own.
    base_path, base_revision = adapter_base(adapter_dir)
    kwargs = {k: v for k, v in (model_kwargs or {}).items() if k not in ("subfolder", "revision")}
    offline = kwargs.get("local_files_only") or is_offline()
    if offline and not os.path.isdir(base_path) and is_repo_id(base_path):
        # a Hub id with downloads off: a base missing from the cache is named, not a bare OSError
        hub_snapshot(
            base_path,
            base_revision,
            cache_dir=kwargs.get("cache_dir"),
            local_files_only=bool(kwargs.get("local_files_only")),
            needs=("config.json",),
            wanted_by=f"the base model of the adapter in {adapter_dir}",
        )
    base = causal_lm_from_pretrained(base_path, revision=base_revision, **kwargs)
    check_adapter_fits(base, weights, adapter_dir)
    if merge:
        # The tuner alone: PeftModel would wrap it, reading a deprecated transformers property
        # on the way (module docstring), for a wrapper merge_and_unload throws away.
        return merged_adapter(base, adapter_dir, weights)
    from peft import PeftModel

    model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=False)
    model.eval()
    return model


def merged_adapter(base_model, adapter_dir: str | os.PathLike, weights: dict[str, Any] | None = None):
    """``base_model`` (changed in place) with the adapter in ``adapter_dir`` merged into its weights,
    as ``PeftModel.from_pretrained(base_model, adapter_dir).merge_and_unload()`` gives them, bit
    for bit, without constructing the ``PeftModel``: PEFT's tuner for the adapter's type, the
    adapter's weights loaded into it (every one used, none missing), then merged. ``weights``:
    the adapter's tensors when already read (:func:`read_adapter_weights`)."""
    from peft import PEFT_TYPE_TO_TUNER_MAPPING, PeftConfig, set_peft_model_state_dict
    from peft.tuners.tuners_utils import cast_adapter_dtype

    weights = read_adapter_weights(adapter_dir) if weights is None else weights
    config = PeftConfig.from_pretrained(str(adapter_dir))
    tuner_class = PEFT_TYPE_TO_TUNER_MAPPING.get(config.peft_type)
    if config.is_prompt_learning or tuner_class is None or not hasattr(tuner_class, "merge_and_unload"):
        raise ValueError(
            f"adapter {adapter_dir}: a {config.peft_type} adapter has no weights to merge into its base; "
            "load it with merge_adapter false"
        )
    config.inference_mode = True
    name = "default"
    tuner = tuner_class(base_model, {name: config}, name)
    # What PeftModel's constructor does besides reading is_gradient_checkpointing: adapter
    # weights in float32 (bfloat16 or float16 ones upcast), and no simulated tensor parallelism.
    cast_adapter_dtype(tuner.model, adapter_name=name, autocast_adapter_dtype=True)
    if hasattr(tuner.model.config, "pretraining_tp"):
        tuner.model.config.pretraining_tp = 1
    # Saved keys are a PeftModel's, whose ``base_model`` is this tuner.
    result = set_peft_model_state_dict(tuner, {k.removeprefix("base_model."): v for k, v in weights.items()}, name)
    missing = [k for k in result.missing_keys if tuner.prefix in k and f".{name}" in k]
    if result.unexpected_keys or missing:
        problem = (
            f"{len(result.unexpected_keys)} tensors fit no module of the base, e.g. {result.unexpected_keys[0]}"
            if result.unexpected_keys
            else f"it lacks {len(missing)} tensors, e.g. {missing[0]}"
        )
        raise ValueError(f"adapter {Path(adapter_dir) / ADAPTER_WEIGHTS} does not fit its base: {problem}")
    tuner.eval()
    return tuner.merge_and_unload()


def save_adapter(model, output_path: str, state_dict: dict | None = None) -> None:
    """A PEFT model's adapter alone, in PEFT's format (safetensors); its config names a base that
    can be found again (a directory, made absolute, or a Hub id). ``state_dict``: the model's full
    weights when the in-memory ones are shards (PEFT picks the adapter's out of it)."""
    config = model.peft_config["default"]
    base = config.base_model_name_or_path
    hub_id = isinstance(base, str) and base.count("/") == 1 and not os.path.exists(base)
    if not base or not (os.path.isdir(base) or hub_id):
        raise ValueError(
            f"cannot save this LoRA adapter: its base model {base!r} is neither a directory nor a Hub id; "
            "save the base model first and load it from there"
        )
    if os.path.isdir(base):
        config.base_model_name_or_path = os.path.abspath(base)
    model.save_pretrained(output_path, safe_serialization=True, state_dict=state_dict)
    if not os.path.isfile(os.path.join(output_path, ADAPTER_CONFIG)):
        raise RuntimeError(f"PEFT wrote no {ADAPTER_CONFIG} in {output_path}")


def copy_adapter(adapter_dir: str | os.PathLike, output_path: str | os.PathLike, base: str | os.PathLike) -> None:
    """The adapter in ``adapter_dir`` written to ``output_path`` as a model on ``base`` (a directory,
    made absolute): its weights copied byte for byte, its config naming the new base. What
    :func:`save_adapter` writes for the same adapter, without a ``PeftModel`` to write it from."""
    import shutil

    config = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = str(Path(base).resolve())
    os.makedirs(output_path, exist_ok=True)
    shutil.copyfile(Path(adapter_dir) / ADAPTER_WEIGHTS, Path(output_path) / ADAPTER_WEIGHTS)
    (Path(output_path) / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def learned_state_files(folder: str | os.PathLike) -> list[str]:
    """The files of an adapter folder that hold what training learned: its config and every safetensors file at
    its top (the LoRA weights, GRC's latents and A, and whatever a method saves beside them)."""
    with os.scandir(folder) as entries:
        return [ADAPTER_CONFIG, *sorted(e.name for e in entries if e.name.endswith(".safetensors") and e.is_file())]


def _learned_state_digest(path: Path) -> str:
    """sha256 of a learned-state file; of an adapter config, of its settings less ``base_model_name_or_path``,
    which names where the base lies, not what was learned (a base moved and named again stays the same model)."""
    import hashlib

    digest = hashlib.sha256()
    if path.name == ADAPTER_CONFIG:
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            config = None
        if isinstance(config, dict):
            config.pop("base_model_name_or_path", None)
            digest.update(json.dumps(config, sort_keys=True).encode())
            return digest.hexdigest()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def record_learned_state(folder: str | os.PathLike) -> None:
    """Write ``folder``'s :data:`LEARNED_STATE_RECORD`: the digest of each of its :func:`learned_state_files`."""
    digests = {name: _learned_state_digest(Path(folder) / name) for name in learned_state_files(folder)}
    text = json.dumps({"sha256": digests}, indent=2, sort_keys=True) + "\n"
    (Path(folder) / LEARNED_STATE_RECORD).write_text(text, encoding="utf-8")


def check_learned_state(folder: str | os.PathLike) -> None:
    """Refuse an adapter folder whose learned-state files are not the ones its :data:`LEARNED_STATE_RECORD` holds:
    one edited, replaced, removed or added since it was saved, named. A folder without the record (PEFT's own
    ``save_pretrained`` writes none) is not checked. An adapter loads merged, and a merge gives other
    float bits on other hardware, so its files are checked rather than the fingerprint of the weights they give."""
    record = Path(folder) / LEARNED_STATE_RECORD
    if not record.is_file():
        return
    fix = f"Restore it; after a deliberate edit, remove {record} and save the model again to record the files."
    try:
        recorded = json.loads(record.read_text(encoding="utf-8"))["sha256"]
        if not isinstance(recorded, dict):
            raise TypeError("sha256 is not an object")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{record}: unreadable ({error}); restore it, or remove it and save the model again") from None
    found = learned_state_files(folder)
    for name in sorted(set(recorded) | set(found)):
        path = Path(folder) / name
        if name not in found:
            raise FileNotFoundError(f"{path}: missing, though {record.name} records it (saved with the model). {fix}")
        if name not in recorded:
            raise ValueError(f"{path}: not in {record.name}: added after the model was saved. {fix}")
        if _learned_state_digest(path) != recorded[name]:
            raise ValueError(
                f"{path}: not the file the model was saved with ({record.name} records another sha256): replaced "
                f"or edited after saving. {fix}"
            )
