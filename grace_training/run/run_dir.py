"""A run owns its output directory, and a resumed run does not silently change what it trains.

``<output_dir>/grace_run.json`` names the run that owns the directory::

    {"format": 1, "trainer": "grace-train", "algorithm": "grpo", "run_id": "5d0c1e2a9f3b",
     "started": "2025-06-01T11:12:03+00:00", "adopted_checkpoints": []}

Starting a run (:func:`claim_output_dir`) in a directory that is

- absent or empty: a new run (a new marker);
- a run of grace-train (its marker; or, written before markers, a ``config.yaml`` of this trainer
  beside ``metrics.jsonl`` or checkpoints): ``--resume`` continues it (an older one is adopted:
  its leftovers settled, the marker written, naming its checkpoints as the run's); without
  ``--resume`` it is refused, unless ``--overwrite-output-dir``, which deletes that run's own files
  (its checkpoints, metrics, config, marker) before the new one starts;
- anything else that is not empty: refused, unless ``--overwrite-output-dir``: the run then writes
  beside what is there, replacing the files under the names it writes (:func:`run_files`) and nothing
  else; another run's ``checkpoint-*`` in the way of a save is refused, never replaced.

Whatever the algorithm, every refusal comes from :func:`inspect_output_dir`, before anything is deleted.

System and package directories are refused always (:func:`~grace_training.config.output_dirs.forbidden_output_dir`). Checkpoints
carry the run's id (:class:`~grace_training.run.checkpoint.RunFamily`): rotation, cleanup and
``--resume`` touch only the run's own.

``--resume`` compares the config saved with the checkpoint with the one given
(:func:`config_changes`, by ``config.RESUME_CHANGES``): free keys change, keys that change what
is trained need ``--allow-config-change`` (then they apply from the next step and are appended
to ``config_changes.jsonl``), and keys the checkpoint was built from never change.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grace_training.algorithms.base import CHANGES_FILE, CONFIG_FILE
from grace_training.algorithms.registry import ALGORITHMS, current_name
from grace_training.config.train_config import (
    RESUME_CHANGES,
    ConfigError,
    canonical_keys,
    read_yaml_mapping,
)
from grace_training.run.checkpoint import (
    CHECKPOINT,
    REPLACED,
    TEMPORARY,
    RunFamily,
    list_checkpoints,
    remove_incomplete,
    remove_path,
)

logger = logging.getLogger(__name__)

MARKER = "grace_run.json"
TRAINER = "grace-train"
INFONCE = "infonce"


class OutputDirError(RuntimeError):
    """An output directory the run may not take; the message names it and what is in it."""


class ConfigChangeError(RuntimeError):
    """A resumed run's config differs from its checkpoint's in a way that needs a decision."""


def run_files(algorithm: str) -> tuple[str, ...]:
    """The names a run of ``algorithm`` writes in its directory besides checkpoints (its record's ``run_files``):
    deleted with the run they belong to (--overwrite-output-dir on an earlier run), replaced when a new run shares a
    directory."""
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise OutputDirError(f"algorithm {algorithm!r} is not one grace-train trains (one of {', '.join(ALGORITHMS)})")
    return ALGORITHMS[algorithm].run_files


# -- the marker ------------------------------------------------------------------------------------


def read_marker(output_dir: str | Path) -> dict[str, Any] | None:
    """The directory's grace-train marker; None when there is none, or the file is not one."""
    try:
        marker = json.loads((Path(output_dir) / MARKER).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(marker, dict) or marker.get("trainer") != TRAINER or not isinstance(marker.get("run_id"), str):
        return None
    return marker


def family_of(marker: Mapping[str, Any] | None) -> RunFamily | None:
    if marker is None:
        return None
    adopted = marker.get("adopted_checkpoints")
    return RunFamily(marker["run_id"], frozenset(name for name in adopted if isinstance(name, str))
                     if isinstance(adopted, list) else frozenset())


def read_family(output_dir: str | Path) -> RunFamily | None:
    """The checkpoints the directory's run owns; None without a marker (a directory written
    before markers, or none at all: then every checkpoint counts, as it did)."""
    return family_of(read_marker(output_dir))


def marker_algorithm(marker: Mapping[str, Any] | None) -> str:
    """The algorithm a marker's run trains; markers of earlier versions name it ``method`` (``gircse`` for ICR)."""
    if marker is None:
        return "grpo"
    if "algorithm" in marker:
        return marker["algorithm"]
    return current_name(marker.get("method", "grpo"))


def _write_marker(root: Path, algorithm: str, adopted: list[str]) -> RunFamily:
    marker = {
        "format": 1,
        "trainer": TRAINER,
        "algorithm": algorithm,
        "run_id": uuid.uuid4().hex[:12],
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "adopted_checkpoints": adopted,
    }
    root.mkdir(parents=True, exist_ok=True)
    temporary = root / f".{MARKER}.tmp"
    temporary.write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, root / MARKER)
    return family_of(marker)


def _older_run(root: Path) -> bool:
    """A grace-train run written before markers: its ``config.yaml`` (a dump of every key) beside
    ``metrics.jsonl`` or a checkpoint with a trainer state."""
    if not (root / CONFIG_FILE).is_file() or read_marker(root) is not None:
        return False
    if not ((root / "metrics.jsonl").is_file() or list_checkpoints(root)):
        return False
    try:
        keys = read_yaml_mapping(root / CONFIG_FILE)
    except ConfigError:
        return False
    return {"output_dir", "num_rollouts", "learning_rate"} <= set(keys)


# -- claiming the directory ------------------------------------------------------------------------


def inspect_output_dir(
    output_dir: str | Path, *, algorithm: str = "grpo", resume: bool = False, overwrite: bool = False,
    last_step: int | None = None,
) -> str:
    """What starting a run in ``output_dir`` does, without doing it: ``"new"``, ``"continue"``
    (its marker, ``--resume``), ``"adopt"`` (a run from before markers, ``--resume``), ``"replace"``
    (an earlier run, ``--overwrite-output-dir``: its files go first) or ``"share"`` (a directory
    that is not a run, ``--overwrite-output-dir``). Raises :class:`OutputDirError` otherwise.

    ``last_step``: the run's last step; another run's ``checkpoint-<step>`` at or below it would
    be in the way of a save, and is refused here rather than at that save."""
    root = Path(output_dir)
    files = run_files(algorithm)
    entries = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    if not entries:
        return "new"
    marker = read_marker(root)
    earlier = marker is not None or _older_run(root)
    other_algorithm = marker is not None and marker_algorithm(marker) != algorithm
    if earlier and resume and not other_algorithm:
        return "continue" if marker is not None else "adopt"
    if earlier and overwrite:
        _check_replaceable(root, marker, last_step)
        return "replace"
    if earlier and resume:
        raise OutputDirError(
            f"{root} holds a grace-train {marker_algorithm(marker)} run ({_describe(root, marker)}), which --resume "
            f"cannot continue with --algorithm {algorithm}; choose another output_dir"
        )
    if earlier:
        raise OutputDirError(
            f"{root} holds an earlier grace-train run ({_describe(root, marker)}); --resume continues it, "
            "--overwrite-output-dir deletes it (its checkpoints, metrics, config and marker) and starts a new "
            "run, or choose another output_dir"
        )
    if not overwrite:
        raise OutputDirError(
            f"{root} is not empty and is not a grace-train run (it holds {_listing(entries)}); choose a new "
            "or empty output_dir, or pass --overwrite-output-dir to write beside what is there (files named "
            f"as the run's own, {', '.join(files)}, are replaced; nothing else is deleted)"
        )
    in_the_way = _foreign_checkpoints(root, last_step)
    if in_the_way:
        raise OutputDirError(
            f"{root}: {_listing(in_the_way)} would be replaced by this run's checkpoints of the same steps, "
            "and grace-train does not replace checkpoints it did not write: move them away"
        )
    return "share"


def claim_output_dir(
    output_dir: str | Path, *, algorithm: str = "grpo", resume: bool = False, overwrite: bool = False,
    last_step: int | None = None,
) -> RunFamily:
    """Take ``output_dir`` for a run (:func:`inspect_output_dir` says how) and return the run's
    family. One process calls this; the others read the marker it leaves (:func:`read_family`)."""
    root = Path(output_dir)
    action = inspect_output_dir(root, algorithm=algorithm, resume=resume, overwrite=overwrite, last_step=last_step)
    if action == "continue":
        return read_family(root)
    if action == "adopt":
        return _adopt(root, algorithm)
    if action == "replace":
        _delete_earlier_run(root)
    elif action == "share":
        _clear_run_files(root, run_files(algorithm))
    family = _write_marker(root, algorithm, [])
    how = "new" if action == "new" else f"{action}, --overwrite-output-dir"
    logger.info("%s: run %s (%s)", root, family.run_id, how)
    return family


def _adopt(root: Path, algorithm: str) -> RunFamily:
    """A run written before markers, resumed: what its crashes left is settled as the older code
    would have, then its checkpoints are named in the new marker as the run's."""
    remove_incomplete(root)
    adopted = [path.name for _, path in list_checkpoints(root)]
    family = _write_marker(root, algorithm, adopted)
    logger.info("%s: adopted a run from before run markers as run %s (%d checkpoints)", root, family.run_id,
                len(adopted))
    return family


def _check_replaceable(root: Path, marker: Mapping[str, Any] | None, last_step: int | None) -> None:
    """Refuse --overwrite-output-dir on an earlier run where the deletion would be followed by a refusal:
    a run of an algorithm this version does not know (its files cannot be told from others), or another
    run's checkpoint, which stays, at a step this run saves."""
    try:
        run_files(marker_algorithm(marker))
    except OutputDirError as error:
        raise OutputDirError(
            f"{root} holds a grace-train run ({_describe(root, marker)}) whose {error}, so --overwrite-output-dir "
            "cannot tell its files from others; move it away or choose another output_dir"
        ) from None
    family = family_of(marker)
    deleted = {path.name for _, path in list_checkpoints(root, family)}

    def stays(name: str) -> bool:  # as _delete_earlier_run leaves it: a family of None owns every checkpoint
        if CHECKPOINT.match(name):
            return name not in deleted
        return family is not None and not family.owns(root / name)

    in_the_way = [name for name in _foreign_checkpoints(root, last_step) if stays(name)]
    if in_the_way:
        raise OutputDirError(
            f"{root}: {_listing(in_the_way)}, not the earlier run's, would be replaced by this run's checkpoints of "
            "the same steps, and grace-train does not replace checkpoints it did not write: move them away"
        )


def _delete_earlier_run(root: Path) -> None:
    """--overwrite-output-dir on an earlier run (:func:`_check_replaceable` passed): its checkpoints (its own,
    by its marker), their temporaries, its files and its marker go; anything else in the directory stays."""
    marker = read_marker(root)
    family = family_of(marker)
    files = run_files(marker_algorithm(marker))
    deleted = [path.name for path in remove_incomplete(root, family)]
    for _, path in list_checkpoints(root, family):
        remove_path(path)
        deleted.append(path.name)
    deleted += _clear_run_files(root, files)
    remove_path(root / MARKER)
    logger.warning("--overwrite-output-dir: deleted the earlier run in %s: %s", root, ", ".join(deleted) or "no files")


def _clear_run_files(root: Path, files: tuple[str, ...]) -> list[str]:
    found = [name for name in (*files, MARKER) if (root / name).exists() or (root / name).is_symlink()]
    for name in found:
        remove_path(root / name)
    return found


def _foreign_checkpoints(root: Path, last_step: int | None) -> list[str]:
    """Checkpoint-like entries of no run of this directory at a step this run may save."""
    def in_the_way(name: str) -> bool:
        match = CHECKPOINT.match(name)
        if match:
            return last_step is None or int(match.group(1)) <= last_step
        return bool(TEMPORARY.match(name) or REPLACED.match(name))

    return sorted(path.name for path in root.iterdir() if in_the_way(path.name))


def _describe(root: Path, marker: Mapping[str, Any] | None) -> str:
    steps = [step for step, _ in list_checkpoints(root, family_of(marker))]
    saved = f"checkpoints at steps {', '.join(map(str, steps))}" if steps else "no checkpoint yet"
    who = f"run {marker['run_id']}, {marker_algorithm(marker)}" if marker else "written before run markers"
    return f"{who}, {saved}"


def _listing(names: list[str], shown: int = 5) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


# -- a resumed run's config ------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigChange:
    """One key whose value differs from the checkpoint's; ``kind`` from ``config.RESUME_CHANGES``."""

    key: str
    old: Any
    new: Any
    kind: str

    def __str__(self) -> str:
        return f"{self.key}: {json.dumps(self.old)} → {json.dumps(self.new)}"


def saved_config(state: Mapping[str, Any], output_dir: str | Path) -> dict[str, Any] | None:
    """The config a checkpoint was trained with: its trainer state's copy, else the run's config.yaml."""
    if isinstance(state.get("config"), dict):
        return state["config"]
    try:
        return read_yaml_mapping(Path(output_dir) / CONFIG_FILE)
    except ConfigError:
        return None


def config_changes(saved: Mapping[str, Any] | None, config) -> list[ConfigChange]:
    """Each key of ``config`` (a :class:`~grace_training.config.train_config.TrainConfig`) that differs from
    ``saved``; a key the saved config lacks (added since) is compared with its default, the
    value the older code ran with."""
    if saved is None:
        return []
    saved, new = _plain(canonical_keys(saved, warn=False)), _plain(config.to_dict())
    defaults = _plain(_defaults(type(config)))
    return [
        ConfigChange(key, saved.get(key, defaults[key]), value, RESUME_CHANGES[key])
        for key, value in new.items()
        if saved.get(key, defaults[key]) != value
    ]


def check_config_changes(changes: list[ConfigChange], *, allowed: bool, checkpoint: str | Path, step: int) -> None:
    """Refuse what the record of the run could not tell: a changed key the checkpoint was built
    from (always), or one that changes what is trained (unless ``allowed``)."""
    fixed = [change for change in changes if change.kind == "fixed"]
    if fixed:
        raise ConfigChangeError(
            f"--resume from {checkpoint}: {'; '.join(map(str, fixed))}: cannot change in a resumed run, even with "
            "--allow-config-change (the checkpoint was trained so); resume with the saved values, or start a new "
            "run in another output_dir"
        )
    applied = [change for change in changes if change.kind == "applied"]
    if applied and not allowed:
        raise ConfigChangeError(
            f"--resume from {checkpoint}: the config changes what the run trains ({'; '.join(map(str, applied))}); "
            f"resume with the saved values (the run's {CONFIG_FILE}), or pass --allow-config-change to apply them "
            f"from step {step + 1} (recorded in {CHANGES_FILE})"
        )


def record_config_changes(
    output_dir: str | Path, step: int, checkpoint: str | Path, changes: list[ConfigChange]
) -> None:
    """Append one line per changed key to ``config_changes.jsonl``: the run's record of what held
    when (``step``: the checkpoint's; the new value holds from the next step)."""
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lines = [
        json.dumps({"step": step, "key": c.key, "old": c.old, "new": c.new, "kind": c.kind,
                    "checkpoint": Path(checkpoint).name, "time": when})
        for c in changes
    ]
    with open(Path(output_dir) / CHANGES_FILE, "a", encoding="utf-8") as handle:
        handle.write("".join(f"{line}\n" for line in lines))


def _defaults(config_class) -> dict[str, Any]:
    return {
        item.name: item.default if item.default is not dataclasses.MISSING else item.default_factory()
        for item in dataclasses.fields(config_class)
    }


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """As JSON holds them (tuples as lists), so a saved config and a live one compare equal."""
    return json.loads(json.dumps(values, default=str))

