"""One saved setting of the GenerativeEncoder, as a record, and the checks its values are built from.

The record sits below the methods, so that each method declares its own settings beside its engine
(:class:`grace_st.methods.base.Method`); :mod:`grace_st.settings` merges them into the one table.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def is_int(value: Any) -> bool:
    """An int, a NumPy integer too, never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite real number, never a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def int_in(low: int, high: float) -> Callable[[Any], bool]:
    """An int (a NumPy integer too, not a bool) in ``[low, high]``."""
    return lambda value: is_int(value) and low <= value <= high


@dataclass(frozen=True)
class Setting:
    """One saved setting of the GenerativeEncoder: its default, what it means, what it must be, and
    where else it counts. :data:`grace_st.settings.SETTINGS` is the one table of the settings: the constructor's
    defaults and its docstring, ``config_keys`` (what is saved), the rationale cache key, the
    ``grace-st`` options and docs/usage.md's table (:func:`grace_st.settings.settings_table`) are read from it."""

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


def how(cli: str) -> dict[str, Any]:
    """A setting of how a text is encoded: it decides the rationale and has a ``grace-st`` option."""
    return {"decides_rationale": True, "cli": cli}


# instructions, or a fact about the saved weights: no option, and not a key of the rationale cache
WHAT: dict[str, Any] = {"decides_rationale": False, "cli": None}
