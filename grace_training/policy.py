"""The policy a run starts from, and the base model its cards name (GRPO and the InfoNCE baseline)."""

from __future__ import annotations

import warnings
from pathlib import Path

from grace_training.config.train_config import TrainConfig


class ModelLoadError(ValueError):
    """The model a run starts from cannot be loaded; the message names it and why, in one line."""


def check_model_source(path: str) -> None:
    """Refuse a ``model_name_or_path`` that is neither a local directory nor shaped like a Hub id.

    transformers takes a path it cannot find for a Hub id and answers "Repo id must be in the form
    'repo_name' or 'namespace/repo_name'", which hides the real problem: a local path that is not there.
    """
    from grace_st.files.hub import is_repo_id

    if Path(path).expanduser().exists():
        if not Path(path).expanduser().is_dir():
            raise ModelLoadError(f"model_name_or_path: {path} is a file, not a model directory")
        return
    if not is_repo_id(path) or path.startswith((".", "/", "~")):
        raise ModelLoadError(f"model_name_or_path: {path}: no such local directory (and not a Hub model id)")


def load_grace_model(config: TrainConfig, device: str | None = None):
    """The policy as a GRACE SentenceTransformer: a GRACE directory as saved, or any chat causal LM
    wrapped; neither may run code that ships with the model (``grace_st.load``). A model that cannot
    be loaded is a :class:`ModelLoadError` naming it (``grace-train`` prints it as one line)."""
    import grace_st
    from grace_st import GenerativeEncoder

    path = config.model_name_or_path or grace_st.default_model_path(trained=False)
    check_model_source(path)
    try:
        if (Path(path) / "modules.json").is_file():
            model = grace_st.load(path, device=device)
            if isinstance(model[0], GenerativeEncoder):
                return model
        return grace_st.from_causal_lm(path, device=device)
    except (OSError, ValueError, RuntimeError, ImportError) as error:
        why = " ".join(str(error).split())  # one line: transformers' messages run over several
        raise ModelLoadError(f"model_name_or_path: cannot load {path}: {why}") from error


def card_base_model(config: TrainConfig) -> str | None:
    """``base_model`` on the model card: the configured one, else the start model when it is a
    Hub id (``owner/name``); a local path names nothing a reader could fetch."""
    path = config.model_name_or_path
    if config.base_model or not path:
        return config.base_model or None
    if Path(path).exists() or path.count("/") != 1 or path.startswith((".", "/", "~")):
        return None
    return path


def add_lora_adapter(model, config: TrainConfig):
    """The policy as a PEFT LoRA adapter on a frozen base (rank, alpha, targets from the config)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.lora_target_modules,
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # PeftModel's constructor reads the base's is_gradient_checkpointing, which transformers deprecates on every
        # call: PEFT's own use, which a user cannot act on.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = get_peft_model(model, lora)
    if config.init_adapter:
        load_init_adapter(model, config)
    return model


def load_init_adapter(model, config: TrainConfig) -> None:
    """Set the fresh adapter's weights to those of ``config.init_adapter`` (PEFT's format,
    safetensors only), so that a run goes on from a shipped adapter or another run's checkpoint.

    The saved adapter must adapt the layers the config adapts: every LoRA matrix the model has is
    set, none is left at PEFT's initialisation, none is dropped. Its rank may be lower than the
    config's (the rank grows, decisions/D022): with r₀ < r, the first r₀ rows of
    each A are the saved ones and the rest keep PEFT's random initialisation, the first r₀ columns
    of each B are the saved ones rescaled by (α₀/r₀)/(α/r) and the rest zero, so ΔW = B·A·α/r is
    the saved adapter's exactly at step 0 and the new directions start at zero with a gradient.
    """
    import json

    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    from grace_st.files.adapter import ADAPTER_CONFIG, read_adapter_weights

    path = Path(config.init_adapter)
    try:
        saved = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"init_adapter: {path / ADAPTER_CONFIG} is not a readable adapter config ({error})") from error
    saved_r, saved_alpha = saved.get("r"), saved.get("lora_alpha")
    if not isinstance(saved_r, int) or saved_r > config.lora_r:
        raise ValueError(f"init_adapter: {path} has r {saved_r!r}, the config {config.lora_r!r} (a rank can grow, not shrink)")
    if saved_r == config.lora_r and saved_alpha != config.lora_alpha:
        raise ValueError(f"init_adapter: {path} has lora_alpha {saved_alpha!r}, the config {config.lora_alpha!r}")
    if not isinstance(saved_alpha, (int, float)) or saved_alpha <= 0 or saved.get("use_rslora"):
        raise ValueError(f"init_adapter: {path} has lora_alpha {saved_alpha!r} (or rsLoRA scaling), not a plain LoRA scale")
    weights = read_adapter_weights(path)
    ours = get_peft_model_state_dict(model)  # keyed as PEFT saves an adapter, so as ``weights``
    missing, extra = sorted(ours.keys() - weights.keys()), sorted(weights.keys() - ours.keys())
    if missing or extra:
        raise ValueError(
            f"init_adapter: {path} is not the adapter this config builds "
            f"({len(missing)} LoRA matrices missing, e.g. {missing[:1]}; {len(extra)} not in the model, e.g. {extra[:1]}): "
            "lora_target_modules must be the ones it was trained with"
        )
    if saved_r < config.lora_r:
        weights = grown_lora_weights(weights, ours, saved_r, (saved_alpha / saved_r) / (config.lora_alpha / config.lora_r))
    for key, value in weights.items():
        if value.shape != ours[key].shape:
            raise ValueError(f"init_adapter: {path}: {key} has shape {tuple(value.shape)}, the model's {tuple(ours[key].shape)}")
    set_peft_model_state_dict(model, weights)


def grown_lora_weights(saved: dict, fresh: dict, saved_r: int, rescale: float) -> dict:
    """A rank-r₀ adapter's weights embedded in a fresh rank-r one with the same ΔW (see load_init_adapter)."""
    import torch

    grown = {}
    for key, value in saved.items():
        is_a, is_b = ".lora_A." in key, ".lora_B." in key
        if not (is_a or is_b):
            raise ValueError(f"init_adapter: {key}: only LoRA A and B matrices can grow in rank")
        # A keeps PEFT's random rows past r₀; B's columns past r₀ are zero, so the new directions add nothing yet
        target = fresh[key].detach().clone() if is_a else torch.zeros_like(fresh[key])
        part = target[:saved_r] if is_a else target[:, :saved_r]  # a view: writing it writes target
        if value.shape != part.shape:
            raise ValueError(f"init_adapter: {key} has shape {tuple(value.shape)}, the model's first r₀ of it {tuple(part.shape)}")
        part.copy_(value if is_a else value * rescale)
        grown[key] = target
    return grown
