"""A method as one record: everything the encoder, its files, ``explain`` and the server need to know about a way
of thinking before embedding, read from here instead of from tests of its name.

Each method's module declares its :class:`Method` beside its engine (:mod:`grace_st.methods.grace`,
:mod:`~grace_st.methods.gircse`, :mod:`~grace_st.methods.grc`); :data:`grace_st.methods.registry.METHODS` is the one
table of them. The trainer's side of a method is its algorithm's record, named by :attr:`Method.trained_by`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grace_st.setting import Setting

if TYPE_CHECKING:
    from torch import nn

    from grace_st.methods.grace import RationaleEngine


def _no_engine_options(settings: Mapping[str, Any], state: nn.Module | None) -> dict[str, Any]:
    return {}


def _no_rules(values: Mapping[str, Any]) -> list[str]:
    return []


def _no_problem(state: nn.Module, settings: Mapping[str, Any]) -> str | None:
    return None


@dataclass(frozen=True)
class LearnedState:
    """What a method learns beside the LM's weights (GRC: its latent tokens and their adapter A): a torch module the
    encoder holds as ``attribute``, saved as ``file_name`` in the model folder (beside the weights or the LoRA
    adapter), loaded from there, and fingerprinted with the weights (its parameters enter ``weights_key``, so the
    saved ``weights_revision`` covers it). The hooks take the method's own settings, never the encoder."""

    attribute: str
    file_name: str
    load: Callable[[str | Path], nn.Module | None]  # from a model folder; None where the folder has none
    save: Callable[[nn.Module, str | Path], None]  # into a model folder, as file_name
    # (model, the state held now or None, the method's own settings) -> the state the method reads: the one held,
    # or a fresh one where there is none. The encoder's prepare_method_state runs it; a check never does.
    prepare: Callable[[Any, nn.Module | None, Mapping[str, Any]], nn.Module]
    # what is wrong with a held state under the method's own settings (a size that no longer fits), or None
    problem: Callable[[nn.Module, Mapping[str, Any]], str | None] = _no_problem


@dataclass(frozen=True)
class Method:
    """One way a model thinks before it embeds, as the ``method`` setting names it.

    ``engine`` is the class ``GenerativeEncoder.engine`` builds: a :class:`~grace_st.methods.grace.RationaleEngine`
    or a subclass, with the two calls ``generate`` and ``embed`` and the flags the server's scheduler reads
    (``ragged``, ``embeds_decoding_states``).
    """

    name: str
    engine: type[RationaleEngine]
    help: str  # what it does, one clause: the ``method`` setting's help lists each method's
    settings: Mapping[str, Setting] = field(default_factory=dict)  # its own, merged into grace_st.settings.SETTINGS
    # the engine's keywords beyond the shared ones, from the method's own settings and its learned state
    engine_options: Callable[[Mapping[str, Any], nn.Module | None], dict[str, Any]] = _no_engine_options
    # combination rules over the settings (any subset of them), run whatever the method, so a method may refuse
    # its own settings under another: one message a broken rule
    rules: Callable[[Mapping[str, Any]], list[str]] = _no_rules
    default_budget: int | dict[str, int] | None = None  # max_rationale_tokens where none is given; None: the setting's
    budget_note: str = ""  # what max_rationale_tokens means under this method, for that setting's help
    state: LearnedState | None = None
    # extra per-text fields of explain(): (tokenizer, one text's encode features) -> fields
    trace: Callable[[Any, Mapping[str, Any]], dict[str, Any]] | None = None
    vllm: bool = True  # a token generator (vLLM) can write its thoughts
    vllm_refusal: str = ""  # where it cannot: what the method does instead, as use_vllm's refusal says it
    pools_prompt_at_budget_zero: bool = True  # budget 0 pools the prompt itself (GRC reads its latents whatever the budget)
    shipped_adapter: str | None = None  # its folder under grace_st/adapters/, which default_model_path builds on
    trained_by: str = ""  # the name of the grace_training algorithm that trains it

    def own_settings(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """This method's own settings out of ``values`` (every setting, or an encoder's attributes as a mapping)."""
        return {name: values[name] for name in self.settings}
