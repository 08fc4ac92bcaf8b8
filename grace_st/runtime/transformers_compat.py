"""The names transformers 5.x gives the KV cache and activation checkpointing, whichever 5.x is installed.

Later 5.x releases renamed the KV cache argument of every model's ``forward`` and the field of its outputs
from ``past_key_values`` to ``cache`` (the old name still works there, with a FutureWarning: "`past_key_values`
is deprecated and will be removed in version 5.40.0"), and gradient checkpointing to activation
checkpointing (``gradient_checkpointing_enable`` → ``activation_checkpointing_enable``, the training
argument ``gradient_checkpointing`` → ``activation_checkpointing``; the old names warn until v6). Earlier 5.x
releases know only the old names. These helpers pass and read each under the name the installed
transformers (and the model called) takes, so the same call runs on both without a warning.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

CACHE = "cache"
PAST_KEY_VALUES = "past_key_values"


@functools.cache
def _installed_cache_name() -> str:
    """``cache`` where this transformers' model outputs carry the KV cache under that name, else ``past_key_values``."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    return CACHE if CACHE in {field.name for field in dataclasses.fields(BaseModelOutputWithPast)} else PAST_KEY_VALUES


@functools.cache
def _forward_cache_name(module_type: type) -> str:
    """The name ``module_type.forward`` takes the KV cache by: the one its signature names (a model's own code,
    ``trust_remote_code`` included, may still say ``past_key_values``), else (a wrapper taking ``**kwargs``, as
    PEFT's) the installed transformers' name."""
    installed = _installed_cache_name()
    try:
        parameters = inspect.signature(module_type.forward).parameters
    except (AttributeError, TypeError, ValueError):
        return installed
    for name in (installed, CACHE, PAST_KEY_VALUES):
        if name in parameters:
            return name
    return installed


def cache_kwargs(module: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}``, the keyword argument by which ``module`` (a causal LM, its decoder or a PEFT wrapper
    of one) takes a KV cache to read and extend."""
    return {_forward_cache_name(type(module)): cache}


def output_cache(output: Any) -> Any:
    """The KV cache a model's output holds (``output.cache``, or ``output.past_key_values`` on transformers
    releases before the rename)."""
    if CACHE in {field.name for field in dataclasses.fields(output)}:
        return output.cache
    return output.past_key_values


def enable_activation_checkpointing(model: Any) -> None:
    """Recompute activations in the backward pass: ``activation_checkpointing_enable()`` where transformers has
    it, else ``gradient_checkpointing_enable()`` (the same call under its earlier name). A PEFT model forwards
    either to its base model."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is None:
        enable = model.gradient_checkpointing_enable
    enable()


@functools.cache
def activation_checkpointing_argument() -> str:
    """The ``TrainingArguments`` field that turns activation checkpointing on: ``activation_checkpointing``,
    or ``gradient_checkpointing`` on releases before the rename."""
    from transformers import TrainingArguments

    fields = {field.name for field in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
