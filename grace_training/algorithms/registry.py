"""The training algorithms, by name: the one table the loop, the config, the run directory and the CLI read.

Adding an algorithm is its folder under ``grace_training/algorithms/`` (its loss, its
:class:`~grace_training.steps.TrainingStep` and its :class:`~grace_training.algorithms.base.Algorithm` record) and
one line in :data:`BUILT_IN`; a test registers one with :func:`register_algorithm`.
"""

from __future__ import annotations

from grace_training.algorithms import grc, grpo, icr, infonce
from grace_training.algorithms.base import Algorithm

BUILT_IN = (grpo.ALGORITHM, icr.ALGORITHM, grc.ALGORITHM, infonce.ALGORITHM)

ALGORITHMS: dict[str, Algorithm] = {}
# Old algorithm names, still read from configs, run markers and the CLI's --method.
OLD_NAMES = {"gircse": "icr"}


def register_algorithm(record: Algorithm) -> Algorithm:
    """Make ``record`` an algorithm a config may name; a name already taken by another record is refused."""
    taken = ALGORITHMS.get(record.name)
    if taken is not None and taken != record:
        raise ValueError(f"algorithm {record.name!r} is already registered")
    ALGORITHMS[record.name] = record
    return record


def unregister_algorithm(name: str) -> None:
    """Forget an algorithm a test registered."""
    ALGORITHMS.pop(name, None)


def current_name(name: str) -> str:
    """The algorithm's name, an old one (:data:`OLD_NAMES`) replaced."""
    return OLD_NAMES.get(name, name)


def algorithm_list() -> str:
    """One line per algorithm, ``name: summary``: the CLI's help and the docs' list."""
    return "\n".join(f"- `{record.name}`: {record.summary}" for record in ALGORITHMS.values())


for _record in BUILT_IN:
    register_algorithm(_record)
