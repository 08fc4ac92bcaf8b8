"""Where a training run may never live: the filesystem root, system directories, the home directory
itself, the installed packages and the Python environment. The config refuses such an ``output_dir``
before anything runs; :mod:`grace_training.run.run_dir` decides the rest (whose directory it is)."""

from __future__ import annotations

import importlib.util
import os
import site
import sys
import sysconfig
from pathlib import Path

# Linux and macOS directories whose whole tree belongs to the system; and those that are only
# refused themselves (a run may live below /var/tmp, /home/me or /mnt/disk, not in them).
SYSTEM_TREES = (
    "bin",
    "boot",
    "dev",
    "etc",
    "lib",
    "lib32",
    "lib64",
    "libx32",
    "proc",
    "run",
    "sbin",
    "sys",
    "usr",
    "System",
)
SYSTEM_DIRS = (
    "home",
    "media",
    "mnt",
    "opt",
    "root",
    "snap",
    "srv",
    "tmp",
    "var",
    "Applications",
    "Library",
    "Users",
    "Volumes",
    "private",
)


def forbidden_output_dir(path: str | Path) -> str | None:
    """Why ``path`` may never be a run's directory (the root, a system directory, the home
    directory itself, the installed packages or the Python environment), or None.

    Symbolic links are resolved first: a link to ``/etc`` is ``/etc``."""
    target = Path(os.path.realpath(path))
    parts = target.parts[1:]
    if parts[:1] == ("private",) and len(parts) > 1:  # macOS: /etc, /tmp and /var live in /private
        parts = parts[1:]
    if not parts:
        return "the filesystem root"
    if parts[0] in SYSTEM_TREES or (len(parts) == 1 and parts[0] in SYSTEM_DIRS):
        return f"a system directory ({target})"
    if target == Path(os.path.realpath(Path.home())):
        return "the home directory itself"
    for source in _package_dirs():
        if target == source or source in target.parents:
            return f"in the source of an installed package ({source})"
        if target == source.parent:
            return f"the directory holding the package {source.name}"
    for environment in _environment_dirs():
        if target == environment or environment in target.parents:
            return f"in the Python environment ({environment})"
    return None


def _package_dirs() -> list[Path]:
    """grace_st's and this package's sources, found without importing them."""
    found = [Path(__file__).parents[1]]  # grace_training (this module sits in its config/ folder)
    spec = importlib.util.find_spec("grace_st")
    if spec is not None and spec.submodule_search_locations:
        found += [Path(p) for p in spec.submodule_search_locations]
    return [Path(os.path.realpath(p)) for p in found]


def _environment_dirs() -> set[Path]:
    found = {sys.prefix, sys.base_prefix, *site.getsitepackages(), site.getusersitepackages()}
    found |= {sysconfig.get_path(name) for name in ("purelib", "platlib", "stdlib")}
    return {Path(os.path.realpath(p)) for p in found if p}
