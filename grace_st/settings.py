"""The GenerativeEncoder's saved settings: each one's type and range, checked in one place.

The same check runs at construction, when ``grace_config.json`` is read, before every batch
and after the CLI applies its options, so a value that would change what ``encode`` computes
without saying so (``"do_sample": "false"`` is a truthy string) is refused with the setting,
the value and, when it came from a file, the file named.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from grace_st.prompts import DEFAULT_INSTRUCTIONS


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _is_instructions(value: Any) -> bool:
    return isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


# Upper (and lower) bounds of the integer settings. Far above any real use, they only keep a typo
# or a 31-digit limit out of torch, where it would end in an overflow naming neither setting nor file.
MAX_RATIONALE_TOKENS = 32_768  # a rationale's KV cache is allocated for the whole budget
MAX_INPUT_TOKENS = 1_048_576  # a cap on the prompt (the text itself decides its length)
MAX_NUM_RATIONALES = 1_024  # each one is a row of the generation batch
MAX_HIDDEN_LAYER = 1_024  # the model's own layer count bounds it further (check_settings' num_layers)
MAX_LATENT_TOKENS = 4_096  # each one is a position of every pass and of the memory
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes: a 64-bit integer


def int_in(low: int, high: float) -> Callable[[Any], bool]:
    """An int (a NumPy integer too, not a bool) in ``[low, high]``."""
    return lambda value: _is_int(value) and low <= value <= high


def per_prompt_type(low: int, high: float = math.inf) -> Callable[[Any], bool]:
    """An int in ``[low, high]``, or a mapping of prompt type to one, with a ``"default"`` entry
    (no upper bound by default: the trainer's own rules reuse it)."""
    in_range = int_in(low, high)

    def valid(value: Any) -> bool:
        if isinstance(value, Mapping):
            return "default" in value and all(isinstance(k, str) and in_range(v) for k, v in value.items())
        return in_range(value)

    return valid


def for_prompt_type(value: int | Mapping[str, int], prompt_type: str) -> int:
    """A per-prompt-type setting's value for ``prompt_type``: the int itself, or the mapping's
    entry for that type, else its ``"default"`` (mteb's, LangChain's and LlamaIndex's prompt
    names resolve to types as :attr:`GenerativeEncoder.prompt_names` says)."""
    if isinstance(value, Mapping):
        return value.get(prompt_type, value["default"])
    return value


# The prompt types a text is encoded as: encode, encode_query, encode_document (and the prompt names
# that stand for them: sentence-transformers' and LlamaIndex's "text" and "passage" are documents).
PROMPT_TYPES = ("default", "query", "document")


def unknown_prompt_types(value: Any, known: Any = PROMPT_TYPES) -> list[str]:
    """The keys of a per-prompt-type mapping that no text is encoded as (a typo such as ``qeury``
    would otherwise be kept and never used); empty for an int."""
    return sorted(set(value) - set(known)) if isinstance(value, Mapping) else []


def prompt_types(*values: Any) -> set[str]:
    """Every prompt type the per-prompt-type ``values`` name (always ``"default"``)."""
    return {"default"}.union(*(set(v) for v in values if isinstance(v, Mapping)))


@dataclass(frozen=True)
class Setting:
    """One saved setting of the GenerativeEncoder: its default, what it means, what it must be, and
    where else it counts. :data:`SETTINGS` is the one source of the settings: the constructor's
    defaults and its docstring, ``config_keys`` (what is saved), the rationale cache key, the
    ``grace-st`` options and docs/usage.md's table (:func:`settings_table`) are read from it."""

    default: Any
    help: str  # what it does: the constructor's docstring, the CLI's help, docs/usage.md's table
    requirement: str  # what it must be, as an error says it
    valid: Callable[[Any], bool]
    decides_rationale: bool  # keys the rationale cache (instructions enter through the prompt's token ids)
    cli: str | None  # the ``grace-st`` option's kind: "int", "float", "flag", "per_type" (N or TYPE=N,...), "choice"; None: none
    shown_default: str | None = None  # the table's default, where the value itself is too long to show
    choices: tuple[str, ...] | None = None  # a "choice" setting's values

    @property
    def cli_option(self) -> bool:
        return self.cli is not None


def _how(cli: str) -> dict[str, Any]:
    """A setting of how a text is encoded: it decides the rationale and has a ``grace-st`` option."""
    return {"decides_rationale": True, "cli": cli}


_WHAT = {"decides_rationale": False, "cli": None}  # instructions, or a fact about the saved weights
_PER_TYPE = "an int, or a mapping of prompt type to one with a 'default' entry"

# The ways a model thinks before it embeds (grace_st.methods.ENGINES has a class for each).
METHODS = ("grace", "gircse", "grc")
# K of a GIRCSE model built or loaded without a max_rationale_tokens value: the best K of the trained models' K curve
# on the dev scoreboard (docs/gircse.md; decisions/D033).
GIRCSE_DEFAULT_K = 5
# How a text becomes a prompt: the model's chat template, or GIRCSE's reference format (grace_st.prompts).
PROMPT_FORMATS = ("chat", "instruct")

# Combination rules live in check_settings below.
SETTINGS: dict[str, Setting] = {
    "method": Setting(
        "grace",
        "how the model thinks before it embeds: 'grace' writes a rationale of up to max_rationale_tokens tokens "
        "and pools the text and the rationale (GRACE); 'gircse' feeds its next-token distribution back as "
        "max_rationale_tokens soft tokens and pools their states (GIRCSE: deterministic, nothing sampled); 'grc' "
        "writes a response of up to max_rationale_tokens tokens ('None' at 0), then embeds with the final states of "
        "num_latent_tokens learned latent tokens after it (GRC), whose keys and values are also the text's "
        "compressed memory",
        "'grace', 'gircse' or 'grc'",
        lambda v: v in METHODS,
        **_how("choice"),
        choices=METHODS,
    ),
    "prompt_format": Setting(
        "chat",
        "how a text becomes a prompt: 'chat' puts the instruction in the model's chat template as the system turn "
        "and the text as the user turn, thinking starts in the assistant turn; 'instruct' is GIRCSE's reference "
        "format, the plain string 'Instruct: {instruction}\\nQuery:{text}' with no special tokens (the text alone "
        "where the instruction is empty), the soft tokens following the text (method 'gircse' only)",
        "'chat' or 'instruct'",
        lambda v: v in PROMPT_FORMATS,
        **_how("choice"),
        choices=PROMPT_FORMATS,
    ),
    "num_latent_tokens": Setting(
        16,
        "method 'grc': m, the meta latent tokens after the response (learned vectors saved in "
        "latent_tokens.safetensors): the embedding's read-out and the memory's size, the same for any text length",
        f"an int in [1, {MAX_LATENT_TOKENS}]",
        int_in(1, MAX_LATENT_TOKENS),
        **_WHAT,
    ),
    "soft_token_temperature": Setting(
        1.0,
        "method 'gircse': the temperature of each fed-back distribution, softmax(logits / T); 1 is the paper's",
        "a finite number > 0",
        lambda v: _is_number(v) and v > 0,
        **_how("float"),
    ),
    "instructions": Setting(
        DEFAULT_INSTRUCTIONS,
        "system instructions by prompt type: 'default', 'query', 'document'. encode_query / encode_document "
        "pick the matching one; any other type uses 'default' (the grace-st options --instruction, "
        "--query-instruction, --document-instruction set them)",
        "a mapping of prompt type to instruction text",
        _is_instructions,
        **_WHAT,
        shown_default="`grace_st.prompts.DEFAULT_INSTRUCTIONS`",
    ),
    "max_rationale_tokens": Setting(
        256,
        "rationale length limit; 0 pools the prompt alone (the paper's 'Base' row, no generation). An int for "
        "every text, or a budget by prompt type, e.g. {'query': 64, 'document': 0, 'default': 64}: a corpus "
        "embedded once and cheaply, queries that reason (the shipped default model: 0 for every prompt type, "
        f"decisions/D042). Method 'gircse' reads it as K, the soft tokens, and a GIRCSE model built or loaded without a value gets "
        f"K = {GIRCSE_DEFAULT_K} (measured: docs/gircse.md)",
        f"an int in [0, {MAX_RATIONALE_TOKENS}], or a mapping of prompt type to one with a 'default' entry",
        per_prompt_type(0, MAX_RATIONALE_TOKENS),
        **_how("per_type"),
        shown_default=f"`256` (`gircse`: `{GIRCSE_DEFAULT_K}`)",
    ),
    "max_input_tokens": Setting(
        1024,
        "limit on the templated prompt; longer texts are cut at the end so that instruction and template stay "
        "whole. Also model.max_seq_length (the trained default model: 512)",
        f"an int in [1, {MAX_INPUT_TOKENS}]",
        int_in(1, MAX_INPUT_TOKENS),
        **_how("int"),
    ),
    "do_sample": Setting(
        False,
        "sample rationales instead of greedy decoding (greedy: same input, same embedding)",
        "true or false (a bool)",
        lambda v: isinstance(v, bool),
        **_how("flag"),
    ),
    "temperature": Setting(
        1.0, "sampling temperature", "a finite number >= 0", lambda v: _is_number(v) and v >= 0, **_how("float")
    ),
    "top_p": Setting(
        1.0,
        "nucleus sampling: draw from the smallest set of tokens whose probability reaches top_p",
        "a number in (0, 1]",
        lambda v: _is_number(v) and 0 < v <= 1,
        **_how("float"),
    ),
    "repetition_penalty": Setting(
        1.0,
        "CTRL's repetition penalty over the rationale's own tokens (greedy or sampled): a token the rationale "
        "already holds has its logit divided by this (multiplied when negative); 1 turns it off. The text's "
        "tokens are not penalised",
        "a finite number >= 1",
        lambda v: _is_number(v) and v >= 1,
        **_how("float"),
    ),
    "seed": Setting(
        0,
        "with sampling, each text's rationale is seeded from seed and the text, so it does not depend on "
        "batching; null draws from torch's global generator",
        f"null or a 64-bit int, in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]",
        lambda v: v is None or int_in(*SEED_RANGE)(v),
        **_how("int"),
    ),
    "num_rationales": Setting(
        1,
        f"with sampling, average the embeddings of this many rationales a text (test-time scaling); {_PER_TYPE}",
        f"an int in [1, {MAX_NUM_RATIONALES}], or a mapping of prompt type to one with a 'default' entry",
        per_prompt_type(1, MAX_NUM_RATIONALES),
        **_how("per_type"),
    ),
    "hidden_layer": Setting(
        -1,
        "the hidden states pooled: -1 the last layer after the final norm; k transformers' hidden_states[k] "
        "(0: the input embeddings)",
        f"an int in [-1, {MAX_HIDDEN_LAYER}] (-1: the last layer)",
        int_in(-1, MAX_HIDDEN_LAYER),
        **_how("int"),
    ),
    "weights_revision": Setting(
        None,
        "fingerprint of the weights as last saved (written by save, checked at load); with the settings it "
        "makes the revision mteb files results under",
        "a string or null",
        lambda v: v is None or isinstance(v, str),
        **_WHAT,
    ),
    "merge_adapter": Setting(
        True,
        "for a directory that holds a LoRA adapter: merge it into the base's weights at load (true: the "
        "base's speed), or keep it apart as a peft.PeftModel (false: model.disable_adapter() gives the base; "
        "encode runs it apart too, never on a merged weight)",
        "true or false (a bool)",
        lambda v: isinstance(v, bool),
        **_WHAT,
    ),
}

# Each setting's default, read-only: the constructor's signature reads them here.
DEFAULTS = MappingProxyType({name: setting.default for name, setting in SETTINGS.items()})


def default_budget(method: str) -> int | dict[str, int]:
    """``max_rationale_tokens`` where none is given: GIRCSE's measured K for its soft tokens, else the setting's
    default."""
    return GIRCSE_DEFAULT_K if method == "gircse" else default("max_rationale_tokens")


def overridden(current: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The settings ``overrides`` names, given on top of ``current`` (a command line's options over a model's): an
    instruction, or a per-prompt-type value, given for some prompt types leaves the other types theirs."""
    merged = {}
    for name, given in overrides.items():
        now = current[name]
        if name == "instructions" or isinstance(given, Mapping):
            base = dict(now) if isinstance(now, Mapping) else {"default": now}
            merged[name] = {**base, **given}
        else:
            merged[name] = given
    return merged


def default(name: str) -> Any:
    """A fresh copy of a setting's default (mappings are copied, so no instance shares one)."""
    value = SETTINGS[name].default
    return dict(value) if isinstance(value, Mapping) else value


def _shown(setting: Setting) -> str:
    if setting.shown_default is not None:
        return setting.shown_default
    return f"`{json.dumps(setting.default)}`"


def cli_flag(name: str) -> str:
    """A setting's ``grace-st`` option: ``max_rationale_tokens`` → ``--max-rationale-tokens``."""
    return f"--{name.replace('_', '-')}"


def settings_table() -> str:
    """docs/usage.md's table of settings (a test holds docs/usage.md to it)."""
    lines = ["| setting | default | `grace-st` option | meaning |", "|---|---|---|---|"]
    for name, setting in SETTINGS.items():
        option = f"`{cli_flag(name)}`" if setting.cli_option else ""
        lines.append(f"| `{name}` | {_shown(setting)} | {option} | {setting.help} |")
    return "\n".join(lines) + "\n"


def settings_docstring(indent: str = "        ") -> str:
    """The settings' entries of the constructor's docstring (``Args:`` style)."""
    import textwrap

    entries = []
    for name, setting in SETTINGS.items():
        text = f"{name}: {setting.help}. Default {_shown(setting).strip('`')}."
        entries.append(
            textwrap.fill(
                text, 100, initial_indent=indent, subsequent_indent=indent + "    ",
                break_on_hyphens=False, break_long_words=False,
            )
        )
    return "\n".join(entries)


# The settings that decide a rationale and the embedding pooled over it: the rationale cache keys
# its entries by these.
RATIONALE_SETTINGS = tuple(name for name, setting in SETTINGS.items() if setting.decides_rationale)


def _where(source: str | None) -> str:
    return f"{source}: " if source else ""


def check_settings(values: Mapping[str, Any], *, num_layers: int | None = None, source: str | None = None) -> None:
    """Raise ``ValueError`` naming the first setting in ``values`` of the wrong type or range,
    or the first broken combination. ``values`` may hold any subset of :data:`SETTINGS`;
    ``num_layers`` bounds ``hidden_layer``; ``source`` (a file) prefixes the message."""
    where = _where(source)
    for name, value in values.items():
        if name not in SETTINGS:
            raise ValueError(f"{where}unknown setting {name!r}; the settings are {', '.join(SETTINGS)}")
        setting = SETTINGS[name]
        if not setting.valid(value):
            raise ValueError(f"{where}{name} must be {setting.requirement}, got {value!r} ({type(value).__name__})")
    get = values.get
    if "instructions" in values and "default" not in values["instructions"]:
        raise ValueError(f"{where}instructions must contain a 'default' entry")
    known = [*PROMPT_TYPES, *sorted(set(get("instructions") or ()) - set(PROMPT_TYPES))]  # and instructions' own
    for name, setting in SETTINGS.items():
        unknown = unknown_prompt_types(get(name), known) if setting.cli == "per_type" else []
        if unknown:
            raise ValueError(
                f"{where}{name} names the prompt type {', '.join(map(repr, unknown))}, which no text is encoded as; "
                f"the prompt types are {', '.join(map(repr, known))} (the prompt names 'text' and 'passage' "
                "are 'document')"
            )
    budgets, repeats = get("max_rationale_tokens", 1), get("num_rationales", 1)
    for kind in sorted(prompt_types(budgets, repeats)):
        of = "" if kind == "default" else f" (prompt type {kind!r})"
        if for_prompt_type(repeats, kind) > 1 and not get("do_sample", False):
            raise ValueError(f"{where}num_rationales > 1{of} averages sampled rationales: set do_sample=True as well")
        if for_prompt_type(repeats, kind) > 1 and for_prompt_type(budgets, kind) == 0:
            raise ValueError(f"{where}num_rationales > 1{of} needs max_rationale_tokens > 0")
    if get("method", "grace") == "gircse" and get("do_sample", False):
        raise ValueError(f"{where}method 'gircse' samples nothing (its soft tokens are the whole distribution): set do_sample=False")
    if get("prompt_format", "chat") == "instruct" and get("method", "grace") != "gircse":
        raise ValueError(
            f"{where}prompt_format 'instruct' is GIRCSE's reference format (soft tokens right after the text); "
            f"method {get('method', 'grace')!r} thinks in the chat template's assistant turn: use prompt_format 'chat'"
        )
    if get("soft_token_temperature", 1.0) != 1.0 and get("method", "grace") != "gircse":
        raise ValueError(f"{where}soft_token_temperature is GIRCSE's (method 'gircse'); a rationale's is temperature")
    if get("method", "grace") == "gircse" and get("repetition_penalty", 1.0) != 1.0:
        raise ValueError(f"{where}method 'gircse' writes no tokens to penalise (it feeds back soft tokens): set repetition_penalty=1")
    if get("do_sample", False) and not get("temperature", 1.0) > 0:
        raise ValueError(f"{where}temperature must be > 0 when sampling, got {get('temperature')!r}")
    if num_layers is not None and "hidden_layer" in values and not -1 <= values["hidden_layer"] <= num_layers:
        raise ValueError(f"{where}hidden_layer must be -1 or in [0, {num_layers}], got {values['hidden_layer']!r}")


def plain(values: Mapping[str, Any]) -> dict[str, Any]:
    """The same settings as Python ints and floats (a NumPy integer passes :func:`check_settings`
    but would not survive ``json.dump`` or key the rationale cache by value)."""
    out = {}
    for name, value in values.items():
        if name in ("max_rationale_tokens", "num_rationales") and isinstance(value, Mapping):
            value = {kind: int(v) for kind, v in value.items()}
        elif _is_int(value) and type(value) is not int:
            value = int(value)
        elif _is_number(value) and type(value) not in (int, float):
            value = float(value)
        out[name] = value
    return out


def read_settings_file(path: str | os.PathLike) -> dict[str, Any]:
    """A ``grace_config.json``, checked: a clear error naming the file when it is empty,
    not JSON, not an object, or holds an unknown or ill-typed setting."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not valid UTF-8 (byte {error.start}): a damaged settings file") from None
    if not text.strip():
        raise ValueError(f"{path}: the settings file is empty; re-save the model (GenerativeEncoder.save)")
    try:
        values = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path}: not valid JSON ({error.msg}, line {error.lineno} column {error.colno}); a damaged settings file"
        ) from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a JSON object of settings, found {type(values).__name__}")  # noqa: TRY004
    check_settings(values, source=path)
    return values


if __name__ == "__main__":  # python -m grace_st.settings: docs/usage.md's table, to paste between its markers
    print(settings_table(), end="")
