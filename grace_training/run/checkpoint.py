"""Checkpoints: a complete GRACE model directory plus the trainer's state, written atomically.

Layout of ``<output_dir>/checkpoint-<step>/``::

    modules.json, config.json, model.safetensors, tokenizer files, grace_config.json, README.md
        the GRACE sentence-transformers model (also a plain causal-LM directory); a LoRA run
        (finetune: lora) writes adapter_config.json + adapter_model.safetensors instead of
        config.json + model.safetensors, naming its base (grace_st.files.adapter)
    trainer_state/state.json      step, epoch, data position, config, last metrics
    trainer_state/run.json        the id of the run that wrote it (written first; :class:`RunFamily`)
    trainer_state/optimizer.pt    AdamW moments
    trainer_state/scheduler.pt
    trainer_state/rng.pt          Python, NumPy, torch (and CUDA) generator states
    trainer_state/accelerate/     instead of the three files above when several processes train

Everything is written under ``<output_dir>/.tmp-checkpoint-<step>`` and then renamed, so a
``checkpoint-*`` directory is complete or absent: a crash mid-save leaves a temporary
directory that the next start removes, and ``latest_checkpoint`` never sees half a save.

Rotation (keep-last-k) first renames a checkpoint it drops to ``.deleting-checkpoint-<step>``, one
atomic step, and only then deletes it: a kill mid-deletion leaves that name, never a half-deleted
``checkpoint-*``, and the next start's :func:`remove_incomplete` finishes it. A ``checkpoint-*``
directory is never deleted by a cleanup.

Re-saving a step that exists (a resumed run passing it again) moves the old copy to
``.replaced-checkpoint-<step>``, a name :func:`remove_incomplete` puts back when the new copy
never took ``checkpoint-<step>``, and deletes it only once the new copy has: at every instant a
complete copy of the step sits where recovery keeps it.

Loading checks what it can before touching the model (:func:`check_checkpoint`) and raises
:class:`CheckpointError` naming the file for anything unreadable.

A run touches only what it wrote (:class:`RunFamily`): listing for --resume, keep-last-k rotation,
the cleanup of temporaries and a re-save skip or refuse any ``checkpoint-*`` (or look-alike) whose
``run.json`` names another run, so a directory shared with other files never loses them.

The module is the checkpoint contract: what is written in which order is what loading, verifying and rotating
check.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
TEMPORARY_PREFIX = ".tmp-checkpoint-"
REPLACED_PREFIX = ".replaced-checkpoint-"  # a complete old copy during a re-save; never deleted blind
# The exact names write_checkpoint gives its temporaries; anything else with the prefix is not ours.
TEMPORARY = re.compile(rf"^{re.escape(TEMPORARY_PREFIX)}(old-)?\d+$")
DELETING_PREFIX = ".deleting-"  # a checkpoint rotation dropped, renamed before its deletion
DELETING = re.compile(rf"^{re.escape(DELETING_PREFIX)}checkpoint-\d+$")
REPLACED = re.compile(rf"^{re.escape(REPLACED_PREFIX)}(\d+)$")
CORRUPT_PREFIX = "corrupt-"  # a checkpoint --resume could not load, kept for a look, out of rotation
STATE_DIR = "trainer_state"
RUN_FILE = "run.json"
TRAINING_FILES = ("optimizer.pt", "scheduler.pt", "rng.pt")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the file or directory."""


@dataclass(frozen=True)
class RunFamily:
    """The checkpoints one run wrote in its output directory, over all its resumes.

    Each checkpoint (and its staging directory, from the moment it exists) carries
    ``trainer_state/run.json`` with the run's id; ``adopted`` names the checkpoints of a run
    written before run ids existed, taken over when it was resumed (:mod:`.run_dir`). Whatever
    else sits in the directory under a checkpoint-like name is another run's, or the user's.
    """

    run_id: str
    adopted: frozenset[str] = frozenset()

    def owns(self, path: Path) -> bool:
        return path.name in self.adopted or read_run_id(path) == self.run_id


def read_run_id(checkpoint: Path) -> str | None:
    """The id in a checkpoint's ``run.json``; None when it has none (older, foreign or unreadable)."""
    try:
        value = json.loads((checkpoint / STATE_DIR / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return value.get("run_id") if isinstance(value, dict) else None


def _owner(family: RunFamily | None):
    """Who may be touched: a run's own directories; without a family (callers from before run ids), any."""
    return family.owns if family is not None else (lambda path: True)


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step:08d}"


def list_checkpoints(output_dir: str | Path, family: RunFamily | None = None) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first; with ``family``, only those that run wrote."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    owns = _owner(family)
    found = []
    for path in root.iterdir():
        match = CHECKPOINT.match(path.name)
        if match and (path / STATE_DIR / "state.json").is_file() and owns(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(output_dir: str | Path, family: RunFamily | None = None) -> Path | None:
    checkpoints = list_checkpoints(output_dir, family)
    return checkpoints[-1][1] if checkpoints else None


def remove_incomplete(output_dir: str | Path, family: RunFamily | None = None) -> list[Path]:
    """Settle what a crashed save or rotation left behind; returns the temporary directories removed
    (rotation's ``.deleting-checkpoint-*`` among them).

    A replaced checkpoint whose successor never took its name is put back first, so the
    deletion of temporaries that follows can never take the only complete copy of a step.
    Only the exact names :func:`write_checkpoint` uses are looked at, and with ``family`` only
    those that run wrote: a look-alike of another run or of the user is left where it is.
    """
    root = Path(output_dir)
    owns = _owner(family)
    removed = []
    if root.is_dir():
        for path in sorted(root.iterdir()):
            if REPLACED.match(path.name) and owns(path):
                _settle_replaced(root, path, owns)
        for path in root.iterdir():
            if (TEMPORARY.match(path.name) or DELETING.match(path.name)) and owns(path):
                _remove_tree(path)
                removed.append(path)
    return removed


def _settle_replaced(root: Path, aside: Path, owns) -> None:
    step = aside.name.removeprefix(REPLACED_PREFIX)
    final = root / f"checkpoint-{step}"
    trash = root / f"{TEMPORARY_PREFIX}old-{step}"
    if not final.exists() and (aside / STATE_DIR / "state.json").is_file():
        os.replace(aside, final)
        _fsync_dir(root)
        logger.warning("restored %s: a crash came between moving it aside and its re-save taking its place", final)
    elif trash.exists() and not owns(trash):
        logger.warning("left %s in place: %s, in the way of its cleanup, was not written by this run", aside, trash)
    else:  # the re-save is in place: the old copy is redundant, hand it to the temporary cleanup
        _remove_tree(trash)  # a rename cannot land on a non-empty directory
        os.replace(aside, trash)


def _remove_tree(path: Path) -> None:
    """Delete a checkpoint-like directory, its ``run.json`` last: a deletion cut short leaves a
    directory that still says whose it is, so the next start's cleanup can finish it."""
    for parent in (path, path / STATE_DIR):
        if parent.is_dir() and not parent.is_symlink():
            for child in parent.iterdir():
                if child.name not in (STATE_DIR, RUN_FILE):
                    remove_path(child)
    remove_path(path)


def remove_path(path: Path) -> None:
    """A file, link or directory tree; nothing when it is not there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def rng_state() -> dict[str, Any]:
    """Every generator's state, in types ``torch.load(weights_only=True)`` reads (numpy's keys as a tensor)."""
    algorithm, keys, position, has_gauss, cached = np.random.get_state()
    numpy_state = {
        "algorithm": algorithm,
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "position": int(position),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):
        keys = numpy_state["keys"].numpy().astype(np.uint32)
        numpy_state = (
            numpy_state["algorithm"], keys, numpy_state["position"], numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    np.random.set_state(numpy_state)  # a tuple: checkpoints written before the state was stored as tensors
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_model_dir(st_model, directory: Path, state_dict: dict | None = None) -> None:
    """The GRACE model directory. ``state_dict``: full weights gathered from a sharded policy."""
    # The card is ours (grace_st.model_cards), written after; sentence-transformers' own is slow.
    if state_dict is None:
        st_model.save(str(directory), create_model_card=False)
        return
    with st_model[0].saving_weights(state_dict):
        st_model.save(str(directory), create_model_card=False)


def write_checkpoint(
    output_dir: str | Path,
    step: int,
    *,
    write_model,
    trainer_state: dict[str, Any],
    optimizer=None,
    scheduler=None,
    accelerator=None,
    write_extra=None,
    family: RunFamily | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically and return its path.

    ``write_model(path)`` writes the model directory; ``write_extra(path)`` anything else
    (the model card). With an ``accelerator`` running several processes, every process calls
    this and ``accelerator.save_state`` writes the sharded optimizer; only the main process
    writes the rest and renames, once every process has written its part. With ``family``, the
    checkpoint is marked as that run's, and a directory of another run under one of the names the
    save uses is refused, never replaced.
    """
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    staging = root / f"{TEMPORARY_PREFIX}{step:08d}"
    distributed = accelerator is not None and accelerator.num_processes > 1
    main = accelerator is None or accelerator.is_main_process
    _check_names_free(root, (staging, final), family)  # on every process, so a refusal stops them all
    if distributed:
        accelerator.wait_for_everyone()  # ... before the main one touches those names
    if main:
        _remove_tree(staging)
        (staging / STATE_DIR).mkdir(parents=True)
        if family is not None:  # first: from now on the staging directory says whose it is
            (staging / STATE_DIR / RUN_FILE).write_text(json.dumps({"run_id": family.run_id}), encoding="utf-8")
    if distributed:
        accelerator.wait_for_everyone()
        accelerator.save_state(str(staging / STATE_DIR / "accelerate"))
        accelerator.wait_for_everyone()  # each process writes its own random state: all in before the rename
    if main:
        write_model(staging)
        if write_extra is not None:
            write_extra(staging)
        state_dir = staging / STATE_DIR
        if not distributed:
            torch.save(optimizer.state_dict(), state_dir / "optimizer.pt")
            torch.save(scheduler.state_dict(), state_dir / "scheduler.pt")
            torch.save(rng_state(), state_dir / "rng.pt")
        # state.json last: its presence marks the staging directory complete.
        (state_dir / "state.json").write_text(json.dumps(trainer_state, indent=2, default=str), encoding="utf-8")
        _fsync_tree(staging)
        if final.exists():  # a re-save of the same step (e.g. after a resume): replace it whole
            _replace_checkpoint(root, staging, final)
        else:
            os.replace(staging, final)
        _fsync_dir(root)
    if distributed:
        accelerator.wait_for_everyone()
    return final


def _check_names_free(root: Path, paths: tuple[Path, Path], family: RunFamily | None) -> None:
    """A save overwrites its staging directory and replaces an older copy of its step (moved
    aside, then deleted): refuse before writing when one of those names is another run's."""
    if family is None:
        return
    staging, final = paths
    step = final.name.removeprefix("checkpoint-")
    names = (staging, final, root / f"{REPLACED_PREFIX}{step}", root / f"{TEMPORARY_PREFIX}old-{step}")
    foreign = [path for path in names if path.exists() and not family.owns(path)]
    if foreign:
        raise CheckpointError(
            f"{foreign[0]}: in the way of saving {final.name}, and not written by this run (run id "
            f"{family.run_id}); grace-train does not replace it: move it out of {root}"
        )


def _replace_checkpoint(root: Path, staging: Path, final: Path) -> None:
    """Swap a complete staging directory in for an existing checkpoint of the same step.

    The old copy waits under ``.replaced-checkpoint-*`` (restored by :func:`remove_incomplete`
    if the process dies before the next rename) and becomes a temporary, deletable directory
    only after the new copy holds the final name.
    """
    step = final.name.removeprefix("checkpoint-")
    aside = root / f"{REPLACED_PREFIX}{step}"
    trash = root / f"{TEMPORARY_PREFIX}old-{step}"
    for leftover in (aside, trash):  # from an earlier crash; ``final`` exists, so both are redundant
        _remove_tree(leftover)
    os.replace(final, aside)
    _fsync_dir(root)
    os.replace(staging, final)
    _fsync_dir(root)
    os.replace(aside, trash)
    _remove_tree(trash)


def _fsync_dir(directory: Path) -> None:
    """Make renames inside ``directory`` durable (its entry list is what a power cut could lose)."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:  # platforms that cannot open a directory have no directory fsync either
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def _fsync_tree(directory: Path) -> None:
    """Flush file contents before the rename publishes them (a power cut after the rename
    must not leave a named but empty checkpoint)."""
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def read_trainer_state(checkpoint: str | Path) -> dict[str, Any]:
    file = Path(checkpoint) / STATE_DIR / "state.json"
    try:
        state = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{file}: not a readable trainer state ({error})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{file}: not a trainer state (no integer 'step')")
    return state


def check_checkpoint(checkpoint: str | Path) -> dict[str, Any]:
    """What can be checked without loading: the state parses, every file a load reads is there and
    each safetensors file is as long as its header says. Returns the trainer state."""
    checkpoint = Path(checkpoint)
    state = read_trainer_state(checkpoint)
    state_dir = checkpoint / STATE_DIR
    if not (state_dir / "accelerate").is_dir():
        for name in TRAINING_FILES:
            file = state_dir / name
            if not file.is_file() or file.stat().st_size == 0:
                raise CheckpointError(f"{file}: missing or empty")
    weights = sorted(checkpoint.glob("*.safetensors"))
    if not weights:
        raise CheckpointError(f"{checkpoint}: no *.safetensors weights")
    for file in weights:
        _check_safetensors_length(file)
    return state


def _check_safetensors_length(file: Path) -> None:
    """A truncated or overwritten safetensors file: its header (8-byte length, then JSON) names
    every tensor's byte range; the data must end exactly at the end of the file."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > size - 8:
                raise ValueError(f"header of {length} bytes in a file of {size}")
            header = json.loads(handle.read(length))
        end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
        raise CheckpointError(f"{file}: not a readable safetensors file ({error})") from None
    if 8 + length + end != size:
        raise CheckpointError(f"{file}: {size} bytes, but its header describes {8 + length + end} (truncated?)")


def load_checkpoint(checkpoint: str | Path, *, policy, optimizer, scheduler, accelerator=None) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and RNG from a checkpoint; returns its trainer state.

    Raises :class:`CheckpointError` naming the file for a checkpoint that cannot be loaded. The
    checks run before anything is touched; a failure later, in a file that passed them, can leave
    the policy part-loaded, and a successful load of another checkpoint overwrites all of it.
    """
    checkpoint = Path(checkpoint)
    state = check_checkpoint(checkpoint)
    state_dir = checkpoint / STATE_DIR
    if (state_dir / "accelerate").is_dir() and accelerator is not None:
        try:
            accelerator.load_state(str(state_dir / "accelerate"))
        except Exception as error:  # whatever accelerate raises, the path is the news
            raise CheckpointError(f"{state_dir / 'accelerate'}: cannot be loaded ({error})") from error
        return state

    adapter = checkpoint / "adapter_model.safetensors"
    if adapter.is_file():  # a LoRA run: the checkpoint holds the adapter only (PEFT's format)
        from peft import set_peft_model_state_dict

        if not hasattr(policy, "peft_config"):
            raise CheckpointError(f"{checkpoint}: holds a LoRA adapter, but the policy has none (set finetune: lora)")
        try:
            result = set_peft_model_state_dict(policy, _load_safetensors(adapter))
        except (RuntimeError, ValueError, KeyError) as error:  # shapes that do not fit (another rank, model)
            raise CheckpointError(f"{adapter}: does not fit the policy ({error})") from error
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise CheckpointError(
                f"{checkpoint}: adapter weights do not match the policy (unexpected {unexpected[:5]})"
            )
        _load_training_state(checkpoint, optimizer, scheduler)
        return state
    weights = {}
    # the LM's weights only (model.safetensors or its shards): what an algorithm trains beside them is load_state_file's
    for file in sorted(checkpoint.glob("model*.safetensors")):
        weights.update(_load_safetensors(file))
    try:
        missing, unexpected = policy.load_state_dict(weights, strict=False)
    except RuntimeError as error:  # a shape mismatch: the checkpoint is of another model
        raise CheckpointError(f"{checkpoint}: weights do not fit the policy ({error})") from error
    # Tied embeddings are saved once; the tied parameter is restored through its twin.
    tied = set(getattr(policy, "_tied_weights_keys", None) or [])
    missing = [m for m in missing if m not in tied and not _is_tied(policy, m)]
    if missing or unexpected:
        raise CheckpointError(
            f"{checkpoint}: weights do not match the policy (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    _load_training_state(checkpoint, optimizer, scheduler)
    return state


def load_state_file(checkpoint: str | Path, file_name: str, module: torch.nn.Module, what: str) -> None:
    """Parameters an algorithm trains beside the policy (``file_name``, a safetensors file the model directory holds,
    e.g. GRC's latent tokens) into ``module`` in place, where the optimiser holds them; a checkpoint without the file,
    or with other parameters, is refused. ``what``: the run that saves them, for the message."""
    file = Path(checkpoint) / file_name
    if not file.is_file():
        raise CheckpointError(f"{checkpoint}: no {file_name}, which {what} saves with every checkpoint")
    try:
        with torch.no_grad():
            for name, value in _load_safetensors(file).items():
                module.get_parameter(name).copy_(value)
    except (AttributeError, RuntimeError) as error:
        raise CheckpointError(f"{file}: does not fit the run's parameters ({error})") from error


def _load_training_state(checkpoint: Path, optimizer, scheduler) -> None:
    state_dir = checkpoint / STATE_DIR
    for name, restore in (
        ("optimizer.pt", optimizer.load_state_dict),
        ("scheduler.pt", scheduler.load_state_dict),
        ("rng.pt", set_rng_state),
    ):
        value = _torch_load(state_dir / name)
        try:
            restore(value)
        except (RuntimeError, ValueError, KeyError, TypeError) as error:  # it unpickled, but holds something else
            raise CheckpointError(f"{state_dir / name}: does not fit this run ({error})") from error


def _numpy_array_globals() -> list:
    """What an older ``rng.pt`` (numpy's state as an array) needs besides tensors: numpy's array
    reconstruction only, the allow-list PyTorch documents for numpy arrays."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _torch_load(file: Path) -> Any:
    """A trainer-state file, read with ``weights_only=True``: tensors and plain containers only, so a
    checkpoint someone hands over cannot run code when it is resumed."""
    try:
        with torch.serialization.safe_globals(_numpy_array_globals()):
            return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # unpickling fails in many ways; each is a bad file
        raise CheckpointError(f"{file}: cannot be loaded ({type(error).__name__}: {error})") from error


def _load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except Exception as error:  # safetensors raises its own error types
        raise CheckpointError(f"{file}: cannot be loaded ({type(error).__name__}: {error})") from error


def set_aside_corrupt(checkpoint: Path) -> Path:
    """Rename a checkpoint --resume could not load to ``corrupt-checkpoint-*``: out of
    ``list_checkpoints`` (so keep-last-k does not count it against the good ones) but not deleted."""
    target = checkpoint.with_name(f"{CORRUPT_PREFIX}{checkpoint.name}")
    suffix = 1
    while target.exists():
        target = checkpoint.with_name(f"{CORRUPT_PREFIX}{checkpoint.name}.{suffix}")
        suffix += 1
    os.replace(checkpoint, target)
    return target


def load_newest_loadable(
    output_dir: str | Path, load, accelerator, family: RunFamily | None = None
) -> tuple[Path | None, dict[str, Any] | None]:
    """``(path, load(path))`` for the newest checkpoint in ``output_dir`` (of ``family``, when
    given) that ``load`` takes, or ``(None, None)`` when there is none. Each newer one that raises
    :class:`CheckpointError` is logged with its reason and set aside (:func:`set_aside_corrupt`)
    once a loadable one is found; none loadable raises :class:`CheckpointError` listing every
    reason. With several processes, every one calls this; only the main one renames."""
    candidates = [path for _, path in reversed(list_checkpoints(output_dir, family))]
    if not candidates:
        return None, None
    skipped: list[tuple[Path, CheckpointError]] = []
    for path in candidates:
        try:
            state = load(path)
        except CheckpointError as error:
            logger.warning("--resume: skipping %s: %s", path, error)
            skipped.append((path, error))
            continue
        if skipped:
            accelerator.wait_for_everyone()  # no process may still be reading them
            if accelerator.is_main_process:
                for corrupt, _ in skipped:
                    target = set_aside_corrupt(corrupt)
                    logger.warning(
                        "--resume: renamed %s to %s (kept for a look, out of rotation)", corrupt.name, target.name
                    )
            accelerator.wait_for_everyone()
            names = ", ".join(p.name for p, _ in skipped)
            logger.warning("--resume: took %s, the newest loadable checkpoint; skipped %s", path, names)
        return path, state
    reasons = "; ".join(str(error) for _, error in skipped)
    raise CheckpointError(f"--resume: no loadable checkpoint in {output_dir} ({reasons})")


def _is_tied(policy, name: str) -> bool:
    output = policy.get_output_embeddings() if hasattr(policy, "get_output_embeddings") else None
    inputs = policy.get_input_embeddings() if hasattr(policy, "get_input_embeddings") else None
    return (
        output is not None and inputs is not None and output.weight is inputs.weight and name.endswith("lm_head.weight")
    )


def rotate_checkpoints(
    output_dir: str | Path, keep: int | None, protected: set[str] | None = None, family: RunFamily | None = None
) -> list[Path]:
    """Keep the ``keep`` newest checkpoints (of ``family``, when given: another run's checkpoint,
    however high its step, neither counts nor goes); never delete one still waiting for a Hub push.

    Each one dropped is renamed to ``.deleting-<name>`` before its files go, so a kill part way
    leaves a name the next start removes (:func:`remove_incomplete`), not a broken checkpoint."""
    if not keep:
        return []
    protected = {str(Path(p).resolve()) for p in (protected or set())}
    checkpoints = list_checkpoints(output_dir, family)
    owns = _owner(family)
    removed = []
    for _, path in checkpoints[: max(len(checkpoints) - keep, 0)]:
        if str(path.resolve()) in protected:
            continue
        doomed = path.with_name(f"{DELETING_PREFIX}{path.name}")
        if doomed.exists() or doomed.is_symlink():
            if not owns(doomed):
                logger.warning("kept %s: %s, in the way of its deletion, was not written by this run", path, doomed)
                continue
            _remove_tree(doomed)  # an earlier kill's leftover of the same step: a rename cannot land on it
        os.replace(path, doomed)
        _fsync_dir(path.parent)
        _remove_tree(doomed)
        removed.append(path)
    return removed
