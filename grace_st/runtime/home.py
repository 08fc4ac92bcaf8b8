"""Where grace-st keeps what it builds on this machine (the default model, compiled kernels, wheels):
``$GRACE_ST_HOME``, else ``~/.cache/grace_st``. Its own module so that a kernel can find its cache folder
without importing the default model's bootstrap."""

from __future__ import annotations

import os
from pathlib import Path


def grace_home() -> Path:
    return Path(os.environ.get("GRACE_ST_HOME", Path.home() / ".cache" / "grace_st")).expanduser()
