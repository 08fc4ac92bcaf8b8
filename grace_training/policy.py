"""The policy a run starts from, and the base model its cards name (GRPO and the InfoNCE baseline)."""

from __future__ import annotations

from pathlib import Path

from .config import GRPOConfig


def load_grace_model(config: GRPOConfig, device: str | None = None):
    """The policy as a GRACE SentenceTransformer: a GRACE directory as saved, or any chat causal LM
    wrapped; neither may run code that ships with the model (``grace_st.load``)."""
    import grace_st
    from grace_st import GenerativeEncoder

    path = config.model_name_or_path or grace_st.default_model_path(trained=False)
    if (Path(path) / "modules.json").is_file():
        model = grace_st.load(path, device=device)
        if isinstance(model[0], GenerativeEncoder):
            return model
    return grace_st.from_causal_lm(path, device=device)


def card_base_model(config: GRPOConfig) -> str | None:
    """``base_model`` on the model card: the configured one, else the start model when it is a
    Hub id (``owner/name``); a local path names nothing a reader could fetch."""
    path = config.model_name_or_path
    if config.base_model or not path:
        return config.base_model or None
    if Path(path).exists() or path.count("/") != 1 or path.startswith((".", "/", "~")):
        return None
    return path


def add_lora_adapter(model, config: GRPOConfig):
    """The policy as a PEFT LoRA adapter on a frozen base (rank, alpha, targets from the config)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.lora_target_modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)
