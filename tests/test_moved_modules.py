"""Module paths from before the layer folders still import, for one release, as the new modules themselves."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from grace_st.moved_modules import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_is_the_new_module_and_warns_with_its_new_path(old):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])


def test_names_imported_from_old_paths_are_the_new_objects():
    from grace_st.methods.grace import RationaleEngine
    from grace_st.runtime.batch import masked_mean

    sys.modules.pop("grace_st.batch", None)
    sys.modules.pop("grace_st.engine", None)
    with pytest.warns(DeprecationWarning):
        from grace_st.batch import masked_mean as old_masked_mean
        from grace_st.engine import RationaleEngine as OldEngine
    assert (old_masked_mean, OldEngine) == (masked_mean, RationaleEngine)


def test_python_m_runs_a_moved_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "grace_training.export_adapter", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "--into-package" in result.stdout
