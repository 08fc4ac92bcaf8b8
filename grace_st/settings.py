"""The GenerativeEncoder's saved settings: each one's type and range, checked in one place.

The same check runs at construction, when ``grace_config.json`` is read, before every batch
and after the CLI applies its options, so a value that would change what ``encode`` computes
without saying so (``"do_sample": "false"`` is a truthy string) is refused with the setting,
the value and, when it came from a file, the file named.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from grace_st.methods.gircse import GIRCSE_DEFAULT_K  # noqa: F401 (the GIRCSE budget, where callers look for it)
from grace_st.methods.grc import MAX_LATENT_TOKENS  # noqa: F401 (a bound, where callers look for it)
from grace_st.methods.registry import METHODS, on_change  # METHODS: the records, by name
from grace_st.prompts import DEFAULT_INSTRUCTIONS
from grace_st.setting import WHAT as _WHAT
from grace_st.setting import Setting, int_in
from grace_st.setting import how as _how
from grace_st.setting import is_int as _is_int
from grace_st.setting import is_number as _is_number


def _is_instructions(value: Any) -> bool:
    return isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


# Upper (and lower) bounds of the integer settings. Far above any real use, they only keep a typo
# or a 31-digit limit out of torch, where it would end in an overflow naming neither setting nor file.
MAX_RATIONALE_TOKENS = 32_768  # a rationale's KV cache is allocated for the whole budget
MAX_INPUT_TOKENS = 1_048_576  # a cap on the prompt (the text itself decides its length)
MAX_NUM_RATIONALES = 1_024  # each one is a row of the generation batch
MAX_HIDDEN_LAYER = 1_024  # the model's own layer count bounds it further (check_settings' num_layers)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes: a 64-bit integer


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


_PER_TYPE = "an int, or a mapping of prompt type to one with a 'default' entry"

# How a text becomes a prompt: the model's chat template, or GIRCSE's reference format (grace_st.prompts).
PROMPT_FORMATS = ("chat", "instruct")

# The settings every method shares. "method" and "max_rationale_tokens" name the methods, so their entries are built
# from grace_st.methods.registry.METHODS (_method_setting, _budget_setting); each method's own settings come from its
# record and follow "prompt_format". Combination rules live in check_settings below and in each method's record.
_SHARED: dict[str, Setting | None] = {
    "method": None,
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
    "max_rationale_tokens": None,  # _budget_setting(): its help names each method's own budget
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
_BUDGET_HELP = (
    "rationale length limit; 0 pools the prompt alone (the paper's 'Base' row, no generation). An int for "
    "every text, or a budget by prompt type, e.g. {'query': 64, 'document': 0, 'default': 64}: a corpus "
    "embedded once and cheaply, queries that reason (the shipped default model: 0 for every prompt type, "
    "decisions/D042)"
)
_BUDGET_DEFAULT = 256


def _one_of(names: list[str]) -> str:
    quoted = [f"'{name}'" for name in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _method_setting() -> Setting:
    """The ``method`` setting: its help and choices list :data:`METHODS`."""
    names = list(METHODS)
    ways = "; ".join(f"'{name}' {method.help}" for name, method in METHODS.items())
    return Setting(
        "grace",
        f"how the model thinks before it embeds: {ways}",
        _one_of(names),
        lambda v: v in METHODS,
        **_how("choice"),
        choices=tuple(names),
    )


def _budget_setting() -> Setting:
    """``max_rationale_tokens``: its help and shown default say what each method makes of it."""
    notes = [method.budget_note for method in METHODS.values() if method.budget_note]
    own = [f"`{name}`: `{json.dumps(m.default_budget)}`" for name, m in METHODS.items() if m.default_budget is not None]
    return Setting(
        _BUDGET_DEFAULT,
        ". ".join([_BUDGET_HELP, *notes]),
        f"an int in [0, {MAX_RATIONALE_TOKENS}], or a mapping of prompt type to one with a 'default' entry",
        per_prompt_type(0, MAX_RATIONALE_TOKENS),
        **_how("per_type"),
        shown_default=f"`{_BUDGET_DEFAULT}`" + (f" ({', '.join(own)})" if own else ""),
    )


SETTINGS: dict[str, Setting] = {}  # the one table: the shared settings with every method's own merged in
_defaults: dict[str, Any] = {}
# Each setting's default, read-only: the constructor's signature reads them here.
DEFAULTS = MappingProxyType(_defaults)
SETTING_NAMES: list[str] = []  # the table's names, the encoder's config_keys (kept in step with it)
# The settings that decide a rationale and the embedding pooled over it: the rationale cache keys
# its entries by these.
RATIONALE_SETTINGS: tuple[str, ...] = ()


def _merge() -> None:
    """Build :data:`SETTINGS` (in place: every importer holds the one table) and what is read from it, from the
    shared settings and :data:`METHODS`; run again whenever a method is registered."""
    global RATIONALE_SETTINGS
    built = {"method": _method_setting(), "max_rationale_tokens": _budget_setting()}
    own = {name: setting for method in METHODS.values() for name, setting in method.settings.items()}
    table: dict[str, Setting] = {}
    for name, setting in _SHARED.items():
        table[name] = built.get(name) or setting
        if name == "prompt_format":
            table.update(own)
    SETTINGS.clear()
    SETTINGS.update(table)
    _defaults.clear()
    _defaults.update({name: setting.default for name, setting in table.items()})
    SETTING_NAMES[:] = list(table)
    RATIONALE_SETTINGS = tuple(name for name, setting in table.items() if setting.decides_rationale)


_merge()
on_change(_merge)


def default_budget(method: str) -> int | dict[str, int]:
    """``max_rationale_tokens`` where none is given: the method's own (GIRCSE's measured K for its soft tokens), else
    the setting's default."""
    own = METHODS[method].default_budget if method in METHODS else None
    return own if own is not None else default("max_rationale_tokens")


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
    for method in METHODS.values():  # each method's own combination rules (GIRCSE's: nothing sampled ...)
        problems = method.rules(values)
        if problems:
            raise ValueError(f"{where}{problems[0]}")
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
