"""Models named by a Hub id, found in the Hugging Face cache as ``huggingface_hub`` lays it out
(``models--org--name/snapshots/<commit>``): the GRACE model itself, or an adapter's base.

With downloads off (``HF_HUB_OFFLINE=1`` or ``local_files_only``) one that is not there is an
error naming the repository, the revision, the cache directory and the ``hf download`` command.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

# Pickled and other frameworks' weights: GRACE reads safetensors only, so a snapshot does not fetch them.
UNUSED_WEIGHTS = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.onnx", "*.gguf", "onnx/*", "openvino/*"]


def is_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def is_repo_id(name: str) -> bool:
    """Whether ``name`` is shaped like a Hub model id (``org/name`` or ``name``), not a path."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def snapshot_repo(path: str | os.PathLike | None) -> tuple[str, str] | None:
    """``(repo id, commit)`` of a snapshot directory in a Hugging Face cache
    (``.../models--org--name/snapshots/<commit>``, as ``huggingface_hub`` lays it out), else None."""
    if not path:
        return None
    from huggingface_hub.constants import REPO_ID_SEPARATOR

    snapshot = Path(os.path.abspath(path))
    folder = snapshot.parent.parent.name
    if snapshot.parent.name != "snapshots" or not re.fullmatch(r"[0-9a-f]{40}", snapshot.name):
        return None
    if not folder.startswith(f"models{REPO_ID_SEPARATOR}"):
        return None
    return folder[len(f"models{REPO_ID_SEPARATOR}") :].replace(REPO_ID_SEPARATOR, "/"), snapshot.name


def _download_hint(repo_id: str, revision: str | None, cache_dir: str | os.PathLike | None, switch: str) -> str:
    command = f"hf download {repo_id}"
    if revision:
        command += f" --revision {revision}"
    if cache_dir is not None:
        command += f" --cache-dir {cache_dir}"
    return f"download it once where the Hub can be reached (`{command}`) and load it again, or {switch}"


def _missing(path: str, needs: Sequence[str | tuple[str, ...]]) -> list[str]:
    """The ``needs`` that ``path`` lacks, each as an error names it (a tuple: any one of its files)."""
    alternatives = [(need,) if isinstance(need, str) else tuple(need) for need in needs]
    return [
        " or ".join(names) for names in alternatives if not any(os.path.exists(os.path.join(path, n)) for n in names)
    ]


def hub_snapshot(
    repo_id: str,
    revision: str | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    token: bool | str | None = None,
    local_files_only: bool = False,
    needs: Sequence[str | tuple[str, ...]] = (),
    wanted_by: str | None = None,
) -> str:
    """The local snapshot directory of Hub model ``repo_id``.

    With downloads off (``HF_HUB_OFFLINE=1`` or ``local_files_only``) it is looked up in the
    Hugging Face cache (``cache_dir``, else ``huggingface_hub.constants.HF_HUB_CACHE``);
    otherwise ``snapshot_download`` brings it up to date (safetensors weights only).
    ``revision`` is a branch, tag or commit; sentence-transformers 6.x passes a
    ``ResolvedRevision``, whose commit is used. ``needs`` names files the snapshot must hold (a
    tuple: any one of them). A snapshot or file that is missing is a ``FileNotFoundError`` naming
    the repository, the revision, the cache directory looked in and what to download.
    """
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    commit = getattr(revision, "resolved", None)  # sentence-transformers 6.x: resolved once, up front
    asked = getattr(revision, "initial", None) if commit else (str(revision) if revision else None)
    offline = local_files_only or is_offline()
    cache = os.fspath(cache_dir) if cache_dir is not None else constants.HF_HUB_CACHE
    who = repo_id + (f" at revision {asked}" if asked else "") + (f" ({wanted_by})" if wanted_by else "")
    switches = (["set HF_HUB_OFFLINE=0"] if is_offline() else []) + (
        ["pass local_files_only=False"] if local_files_only else []
    )
    switch = " and ".join(switches) + " to let it download now"
    try:
        path = huggingface_hub.snapshot_download(
            repo_id,
            revision=commit or asked,
            cache_dir=cache_dir,
            token=token,
            local_files_only=offline,
            ignore_patterns=UNUSED_WEIGHTS,
        )
    except LocalEntryNotFoundError as error:
        why = "HF_HUB_OFFLINE=1" if is_offline() else "local_files_only=True"
        raise FileNotFoundError(
            f"{who} is not in the Hugging Face cache (looked in {cache}) and downloads are off ({why}): "
            + _download_hint(repo_id, asked, cache_dir, switch)
        ) from error
    missing = _missing(path, needs)
    if missing and offline:
        raise FileNotFoundError(
            f"{who}: its snapshot in the Hugging Face cache ({path}) lacks {', '.join(missing)}, "
            f"a partial or interrupted download, and downloads are off: "
            + _download_hint(repo_id, asked, cache_dir, switch)
        )
    if missing:
        raise FileNotFoundError(f"{who}: the repository has no {', '.join(missing)} (downloaded to {path})")
    return path
