"""Typed checks for config values: the annotation gives the type, a rule list gives the range.

Kept apart from :mod:`grace_training.config.train_config` so the per-key rules there read as a table. A bad
value raises :class:`ConfigError` naming the key and the value, and (once :meth:`ConfigError.located`
has been called by the loader) the file or override it came from.
"""

from __future__ import annotations

import json
import math
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A setting the run would fail on (or silently misread); one line, naming the key."""

    def __init__(self, message: str, *, key: str | None = None, source: str | None = None) -> None:
        self.message = " ".join(message.split())  # the CLI prints it on one line
        self.key = key
        self.source = source
        super().__init__(f"{source}: {self.message}" if source else self.message)

    def located(self, source: str) -> ConfigError:
        """The same error, saying which file (or override) the value came from."""
        return ConfigError(self.message, key=self.key, source=source)


@dataclass(frozen=True)
class Rule:
    """A range or membership condition; ``description`` completes "<key> must ..."."""

    holds: Callable[[Any], bool]
    description: str


def above(low: float) -> Rule:
    return Rule(lambda v: v > low, f"be > {low}")


def at_least(low: float) -> Rule:
    return Rule(lambda v: v >= low, f"be >= {low}")


def between(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Rule:
    def holds(v: float) -> bool:
        return (v > low if low_open else v >= low) and (v < high if high_open else v <= high)

    return Rule(holds, f"be in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}")


def one_of(choices: Iterable[str]) -> Rule:
    choices = tuple(choices)
    return Rule(lambda v: v in choices, f"be one of {', '.join(choices)}")


def subset_of(choices: Iterable[str]) -> Rule:
    choices = tuple(choices)
    return Rule(lambda v: set(v) <= set(choices), f"only name {', '.join(choices)}")


NON_EMPTY = Rule(lambda v: len(v) > 0, "not be empty")


# -- types ---------------------------------------------------------------------------------------

_NOUNS = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}
_PLURALS = {int: "integers", float: "numbers", str: "strings", bool: "booleans", dict: "mappings"}
_GOT = {
    bool: "boolean",
    int: "integer",
    float: "float",
    str: "string",
    type(None): "null",
    list: "list",
    dict: "mapping",
}


def _arms(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` has the annotated type: bool is not an int, an int is a float, None only if Optional."""
    if hint is Any:
        return True
    if len(_arms(hint)) > 1:
        return any(matches(value, arm) for arm in _arms(hint))
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        return isinstance(value, list) and all(matches(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(matches(k, args[0]) and matches(v, args[1]) for k, v in value.items())
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is type(None):
        return value is None
    return isinstance(value, hint)


def describe(hint: Any) -> str:
    """``list[str] | str`` → "a list of strings or a string"."""
    parts = []
    for arm in _arms(hint):
        origin = typing.get_origin(arm)
        if origin is list:
            (item,) = typing.get_args(arm)
            parts.append(f"a list of {_PLURALS.get(typing.get_origin(item) or item, 'values')}")
        elif origin is dict or arm is dict:
            parts.append("a mapping")
        else:
            parts.append(_NOUNS.get(arm, getattr(arm, "__name__", str(arm))))
    return " or ".join(parts)


def show(value: Any, limit: int = 80) -> str:
    """A value as YAML users write it (null, true, "text", NaN), cut to ``limit`` characters."""
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def kind(value: Any) -> str:
    return _GOT.get(type(value), type(value).__name__)


def accepts(hint: Any, target: type) -> bool:
    return any(arm is target for arm in _arms(hint))


def check_value(key: str, value: Any, hint: Any, rules: Iterable[Rule]) -> None:
    """Type, finiteness of numbers, then each range rule; the first failure raises ConfigError."""
    if not matches(value, hint):
        hint_text = describe(hint)
        got = show(value) if value is None else f"{show(value)} ({kind(value)})"
        message = f"{key}: expected {hint_text}, got {got}"
        if isinstance(value, bool) and accepts(hint, str):
            message += "; YAML reads yes/no/on/off/true/false as booleans, quote the word"
        raise ConfigError(message, key=key)
    if value is None:  # Optional: null means "use the default behaviour", no range applies
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: must be a finite number, got {show(value)}", key=key)
    for rule in rules:
        if not rule.holds(value):
            raise ConfigError(f"{key}: must {rule.description}, got {show(value)}", key=key)


def coerce(value: Any, hint: Any) -> Any:
    """YAML 1.1 reads ``1e-6`` (no dot) as a string; a numeric key gets its number back.

    Only a string for a key that takes no string is touched, and only when it parses: anything
    else is left for :func:`check_value` to refuse with the value in the message.
    """
    if not isinstance(value, str) or accepts(hint, str):
        return value
    for target in (int, float):
        if accepts(hint, target):
            try:
                return target(value)
            except ValueError:
                continue
    return value
