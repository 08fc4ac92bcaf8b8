"""The methods a :class:`~grace_st.encoder.GenerativeEncoder` thinks with, by their saved ``method`` setting:
:data:`METHODS` is the one table of them (:class:`~grace_st.methods.base.Method` records)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from grace_st.methods.base import LearnedState, Method
from grace_st.methods.gircse import GIRCSE
from grace_st.methods.grace import GRACE, RationaleEngine
from grace_st.methods.grc import GRC

METHODS: dict[str, Method] = {}
# What is derived from the table (the merged settings, the constructor's signature): rebuilt on every change.
_listeners: list[Callable[[], None]] = []


def on_change(listener: Callable[[], None]) -> None:
    """Call ``listener`` after every :func:`register` and :func:`unregister`."""
    _listeners.append(listener)


def register(method: Method, *, replace: bool = False) -> Method:
    """Add ``method`` to :data:`METHODS` (its settings join the settings table); a name already taken is refused
    unless ``replace``."""
    if method.name in METHODS and not replace:
        raise ValueError(f"a method named {method.name!r} is already registered")
    taken = {name for other in METHODS.values() if other.name != method.name for name in other.settings}
    if taken & set(method.settings):
        raise ValueError(f"method {method.name!r}: settings {sorted(taken & set(method.settings))} belong to another method")
    METHODS[method.name] = method
    for listener in _listeners:
        listener()
    return method


def unregister(name: str) -> Method:
    """Take a method out of :data:`METHODS` again (tests register their own for a while)."""
    method = METHODS.pop(name)
    for listener in _listeners:
        listener()
    return method


def method_record(name: str) -> Method:
    """The record of the method named ``name``; an unknown name is refused naming the methods there are."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; the methods are {', '.join(map(repr, METHODS))}")
    return METHODS[name]


def learned_state_kinds() -> list[LearnedState]:
    """Every method's learned state, once each, in the table's order: what a model folder may hold beside the
    weights."""
    kinds: dict[str, LearnedState] = {}
    for method in METHODS.values():
        if method.state is not None:
            kinds.setdefault(method.state.attribute, method.state)
    return list(kinds.values())


class _Engines(Mapping):
    """Each method's engine class by its name: a view of :data:`METHODS`."""

    def __getitem__(self, name: str) -> type[RationaleEngine]:
        return METHODS[name].engine

    def __iter__(self) -> Iterator[str]:
        return iter(METHODS)

    def __len__(self) -> int:
        return len(METHODS)


ENGINES: Mapping[str, type[RationaleEngine]] = _Engines()

for _method in (GRACE, GIRCSE, GRC):
    register(_method)
