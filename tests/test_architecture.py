"""The packages' shape, read from their source: which module may import which, no import cycle, and
functions and classes of a size a reader takes in at once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("grace_st", "grace_training")
# grace_training reaches the way a model thinks through the engine and the shared batch tensors only.
GENERATION_INTERNALS = {
    "grace_st.generation",
    "grace_st.decoding",
    "grace_st.pooling",
    "grace_st.second_pass",
    "grace_st.packed_linear",
}
MAX_FUNCTION_LINES, MAX_CLASS_LINES = 60, 480  # sentence-transformers' own Transformer module is 469 lines


def modules() -> dict[str, ast.Module]:
    return {
        f"{package}.{path.stem}" if path.stem != "__init__" else package: ast.parse(path.read_text(encoding="utf-8"))
        for package in PACKAGES
        for path in sorted((ROOT / package).glob("*.py"))
    }


def imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """Every project module ``name`` imports, at module level or inside a function (not for type checkers only)."""
    package = name if name in PACKAGES else name.rsplit(".", 1)[0]
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for inner in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = f"{package}.{base}" if base else package
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
            # `from . import x` of a submodule x imports x; `from .m import f` imports m
            targets = submodules if len(submodules) == len(node.names) else [base, *submodules]
        else:
            continue
        found |= {target for target in targets if target in known and target != name}
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    trees = modules()
    return {name: imports(name, tree, set(trees)) for name, tree in trees.items()}


def test_training_reaches_generation_only_through_the_engine_and_the_batch_module(graph):
    reaching = {
        name: sorted(graph[name] & GENERATION_INTERNALS) for name in graph if name.startswith("grace_training.")
    }
    assert not {name: found for name, found in reaching.items() if found}


def test_the_cache_is_storage_and_the_kernel_does_not_import_the_bootstrap(graph):
    for name in (name for name in graph if name.startswith("grace_st.cache")):
        assert not graph[name] & (GENERATION_INTERNALS | {"grace_st.engine", "grace_st.encoder"}), name
    assert "grace_st.default_model" not in graph["grace_st.native_step"]
    assert "grace_st" not in graph["grace_st.default_model"]  # the package's face imports it, not the reverse


def test_no_import_cycle(graph):
    def cycle_from(start: str, path: list[str]) -> list[str] | None:
        for following in sorted(graph[path[-1]]):
            if following == start:
                return [*path, start]
            if following not in path and following.split(".")[0] == start.split(".")[0]:
                found = cycle_from(start, [*path, following])
                if found:
                    return found
        return None

    cycles = [cycle for name in graph if (cycle := cycle_from(name, [name]))]
    assert not cycles, " → ".join(cycles[0])


def test_functions_and_classes_stay_readable():
    too_long = []
    for name, tree in modules().items():
        for node in ast.walk(tree):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > MAX_FUNCTION_LINES:
                too_long.append(f"{name}.{node.name}: {lines} lines")
            if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
                too_long.append(f"class {name}.{node.name}: {lines} lines")
    assert not too_long
