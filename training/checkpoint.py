"""Checkpoints: a complete GRACE model directory plus the trainer's state, written atomically.

Layout of ``<output_dir>/checkpoint-<step>/``::

    modules.json, config.json, model.safetensors, tokenizer files, grace_config.json, README.md
        the GRACE sentence-transformers model (also a plain causal-LM directory); a LoRA run
        (finetune: lora) writes adapter_config.json + adapter_model.safetensors instead of
        config.json + model.safetensors, naming its base (grace_st.adapter)
    trainer_state/state.json      step, epoch, data position, config, last metrics
    trainer_state/optimizer.pt    AdamW moments
    trainer_state/scheduler.pt
    trainer_state/rng.pt          Python, NumPy, torch (and CUDA) generator states
    trainer_state/accelerate/     instead of the three files above when several processes train

Everything is written under ``<output_dir>/.tmp-checkpoint-<step>`` and then renamed, so a
``checkpoint-*`` directory is complete or absent: a crash mid-save leaves a temporary
directory that the next start removes, and ``latest_checkpoint`` never sees half a save.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
TEMPORARY_PREFIX = ".tmp-checkpoint-"
STATE_DIR = "trainer_state"


def checkpoint_name(step: int) -> str:
    return f"checkpoint-{step:08d}"


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = CHECKPOINT.match(path.name)
        if match and (path / STATE_DIR / "state.json").is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1][1] if checkpoints else None


def remove_incomplete(output_dir: str | Path) -> list[Path]:
    """Delete temporary directories a crashed save left behind; returns what was removed."""
    root = Path(output_dir)
    removed = []
    if root.is_dir():
        for path in root.iterdir():
            if path.name.startswith(TEMPORARY_PREFIX):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_model_dir(st_model, directory: Path, state_dict: dict | None = None) -> None:
    """The GRACE model directory. ``state_dict``: full weights gathered from a sharded policy."""
    encoder = st_model[0]
    # The card is ours (grace_st.model_cards), written after; sentence-transformers' own is slow.
    if state_dict is None:
        st_model.save(str(directory), create_model_card=False)
        return
    original = encoder.model.save_pretrained
    encoder.model.save_pretrained = lambda path, **kw: original(path, state_dict=state_dict, **kw)
    try:
        st_model.save(str(directory), create_model_card=False)
    finally:
        del encoder.model.save_pretrained  # drop the instance attribute, the method shows again


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
) -> Path:
    """Write checkpoint ``step`` atomically and return its path.

    ``write_model(path)`` writes the model directory; ``write_extra(path)`` anything else
    (the model card). With an ``accelerator`` running several processes, every process calls
    this and ``accelerator.save_state`` writes the sharded optimizer; only the main process
    writes the rest and renames.
    """
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    staging = root / f"{TEMPORARY_PREFIX}{step:08d}"
    distributed = accelerator is not None and accelerator.num_processes > 1
    main = accelerator is None or accelerator.is_main_process
    if main:
        shutil.rmtree(staging, ignore_errors=True)
        (staging / STATE_DIR).mkdir(parents=True)
    if distributed:
        accelerator.wait_for_everyone()
        accelerator.save_state(str(staging / STATE_DIR / "accelerate"))
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
            trash = root / f"{TEMPORARY_PREFIX}old-{step:08d}"
            os.replace(final, trash)
            os.replace(staging, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(staging, final)
    if distributed:
        accelerator.wait_for_everyone()
    return final


def _fsync_tree(directory: Path) -> None:
    """Flush file contents before the rename publishes them (a power cut after the rename
    must not leave a named but empty checkpoint)."""
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def read_trainer_state(checkpoint: str | Path) -> dict[str, Any]:
    return json.loads((Path(checkpoint) / STATE_DIR / "state.json").read_text(encoding="utf-8"))


def load_checkpoint(checkpoint: str | Path, *, policy, optimizer, scheduler, accelerator=None) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and RNG from a checkpoint; returns its trainer state."""
    checkpoint = Path(checkpoint)
    state_dir = checkpoint / STATE_DIR
    if (state_dir / "accelerate").is_dir() and accelerator is not None:
        accelerator.load_state(str(state_dir / "accelerate"))
        return read_trainer_state(checkpoint)
    from safetensors.torch import load_file

    adapter = checkpoint / "adapter_model.safetensors"
    if adapter.is_file():  # a LoRA run: the checkpoint holds the adapter only (PEFT's format)
        from peft import set_peft_model_state_dict

        if not hasattr(policy, "peft_config"):
            raise RuntimeError(f"{checkpoint}: holds a LoRA adapter, but the policy has none (set finetune: lora)")
        result = set_peft_model_state_dict(policy, load_file(str(adapter)))
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise RuntimeError(f"{checkpoint}: adapter weights do not match the policy (unexpected {unexpected[:5]})")
        return _load_training_state(checkpoint, optimizer, scheduler)
    weights = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    missing, unexpected = policy.load_state_dict(weights, strict=False)
    # Tied embeddings are saved once; the tied parameter is restored through its twin.
    tied = set(getattr(policy, "_tied_weights_keys", None) or [])
    missing = [m for m in missing if m not in tied and not _is_tied(policy, m)]
    if missing or unexpected:
        raise RuntimeError(
            f"{checkpoint}: weights do not match the policy (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    return _load_training_state(checkpoint, optimizer, scheduler)


def _load_training_state(checkpoint: Path, optimizer, scheduler) -> dict[str, Any]:
    state_dir = checkpoint / STATE_DIR
    optimizer.load_state_dict(torch.load(state_dir / "optimizer.pt", map_location="cpu", weights_only=False))
    scheduler.load_state_dict(torch.load(state_dir / "scheduler.pt", map_location="cpu", weights_only=False))
    set_rng_state(torch.load(state_dir / "rng.pt", map_location="cpu", weights_only=False))
    return read_trainer_state(checkpoint)


def _is_tied(policy, name: str) -> bool:
    output = policy.get_output_embeddings() if hasattr(policy, "get_output_embeddings") else None
    inputs = policy.get_input_embeddings() if hasattr(policy, "get_input_embeddings") else None
    return (
        output is not None and inputs is not None and output.weight is inputs.weight and name.endswith("lm_head.weight")
    )


def rotate_checkpoints(output_dir: str | Path, keep: int | None, protected: set[str] | None = None) -> list[Path]:
    """Keep the ``keep`` newest checkpoints; never delete one still waiting for a Hub push."""
    if not keep:
        return []
    protected = {str(Path(p).resolve()) for p in (protected or set())}
    checkpoints = list_checkpoints(output_dir)
    removed = []
    for _, path in checkpoints[: max(len(checkpoints) - keep, 0)]:
        if str(path.resolve()) in protected:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
