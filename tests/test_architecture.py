"""The packages' shape, read from their source: the layers (which folder may import which), no import cycle,
and functions and classes of a size a reader takes in at once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("grace_st", "grace_training")
# grace_training reaches the way a model thinks through the methods' engines and the shared batch records only.
GENERATION_INTERNALS = ("grace_st.runtime.generation", "grace_st.runtime.decoding", "grace_st.runtime.second_pass",
                        "grace_st.runtime.cpu")
# grace_st's layers, lowest first: a module imports its own layer or lower ones, never a higher one. The CPU kernels
# (with the two runtime leaves they read, the data-file readers and the setting record) feed the runtime; the runtime feeds any method and knows none; the encode vocabulary (prompts, settings, the
# cache, the encode data path) sits on the methods; files and serving on that; the sentence-transformers module on
# all of it; the entry points (the package's face, the CLI, corpus encoding, explain, ...) on top.
LAYERS = (
    ("grace_st.runtime.cpu", "grace_st.runtime.home", "grace_st.runtime.weights", "grace_st.data", "grace_st.setting"),
    ("grace_st.runtime",),
    ("grace_st.methods",),
    ("grace_st.prompts", "grace_st.settings", "grace_st.cache", "grace_st.encoder_inputs", "grace_st.encoder_outputs"),
    ("grace_st.files", "grace_st.serve"),
    ("grace_st.encoder",),
)
MAX_FUNCTION_LINES, MAX_CLASS_LINES = 60, 480  # sentence-transformers' own Transformer module is 469 lines


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, ast.Module]:
    """Every module of both packages, subfolders included."""
    return {
        module_name(path): ast.parse(path.read_text(encoding="utf-8"))
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def layer(name: str) -> int:
    """The layer of a grace_st module (its longest matching prefix); the entry points are above every layer."""
    best, rank = -1, len(LAYERS)
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    return rank


def imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """Every project module ``name`` imports, at module level or inside a function (not for type checkers only)."""
    package = name if (ROOT / name.replace(".", "/")).is_dir() else name.rsplit(".", 1)[0]
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


def test_training_reaches_generation_only_through_the_methods_and_the_batch_records(graph):
    reaching = {
        name: sorted(target for target in graph[name] if target.startswith(GENERATION_INTERNALS))
        for name in graph
        if name.startswith("grace_training")
    }
    assert not {name: found for name, found in reaching.items() if found}


def test_no_grace_st_module_imports_upward_or_imports_training(graph):
    upward = [
        f"{name} → {target}"
        for name in graph
        if name.startswith("grace_st")
        for target in sorted(graph[name])
        if target.startswith("grace_training") or (target.startswith("grace_st.") and layer(target) > layer(name))
    ]
    assert not upward


def test_the_runtime_knows_no_method_and_the_kernels_only_the_runtime_leaves(graph):
    for name in (name for name in graph if name.startswith("grace_st.runtime")):
        outside = {target for target in graph[name] if not target.startswith("grace_st.runtime")}
        assert not outside, f"{name} imports {sorted(outside)}"
    leaves = {"grace_st.runtime.home", "grace_st.runtime.weights"}
    for name in (name for name in graph if name.startswith("grace_st.runtime.cpu")):
        assert graph[name] <= leaves | {n for n in graph if n.startswith("grace_st.runtime.cpu")}, name


def test_every_grace_st_folder_is_a_layer_or_an_entry_point_on_purpose():
    entry_points = {name for name in modules() if name.startswith("grace_st") and layer(name) == len(LAYERS)}
    folders = {name for name in entry_points if (ROOT / name.replace(".", "/")).is_dir()}
    assert folders <= {"grace_st", "grace_st.evaluation", "grace_st.model_cards"}, folders


def test_the_cache_is_storage_and_the_package_face_is_on_top(graph):
    methods = {name for name in graph if name.startswith("grace_st.methods")}
    assert not graph["grace_st.cache"] & {"grace_st.encoder", *methods}
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
