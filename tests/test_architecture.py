"""The packages' shape, read from their source: the layers (which folder may import which), no import cycle,
the encoder's coupling (who may name ``GenerativeEncoder``), and functions of a size a reader takes in at once."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
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
    ("grace_st.prompts", "grace_st.settings", "grace_st.cache", "grace_st.encoding"),
    ("grace_st.files", "grace_st.serve"),
    ("grace_st.encoder",),
)
MAX_FUNCTION_LINES = 60
# The modules besides grace_st.encoder that import GenerativeEncoder, and why; the encode data path, files and
# serving take plain values, the serving scheduler a SentenceTransformer.
ENCODER_IMPORTERS = {
    "grace_st": "the package's face exports it",
    "grace_st.from_causal_lm": "builds one around a causal LM",
    "grace_st.corpus": "reads a saved model's settings with its load_config, no weights loaded",
    "grace_training.policy": "checks that a loaded model's first module is one",
    "grace_training.algorithms.infonce.train": "subclasses it: InfoNCE's prompt-pooling encoder",
}


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


def annotations(tree: ast.Module) -> Iterator[ast.expr]:
    """Every annotation of a module: each parameter's, each return's, each annotated name's."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            arguments = node.args
            every = [*arguments.posonlyargs, *arguments.args, arguments.vararg, *arguments.kwonlyargs, arguments.kwarg]
            yield from (argument.annotation for argument in every if argument is not None and argument.annotation)
            if not isinstance(node, ast.Lambda) and node.returns is not None:
                yield node.returns
        elif isinstance(node, ast.AnnAssign):
            yield node.annotation


def names_the_encoder(node: ast.AST) -> bool:
    """``node`` names GenerativeEncoder: as a name, an attribute, an imported name, or a word of a string
    annotation."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Name) and inner.id == "GenerativeEncoder":
            return True
        if isinstance(inner, ast.Attribute) and inner.attr == "GenerativeEncoder":
            return True
        if isinstance(inner, ast.ImportFrom) and any(alias.name == "GenerativeEncoder" for alias in inner.names):
            return True
        is_text = isinstance(inner, ast.Constant) and isinstance(inner.value, str)
        if is_text and re.search(r"\bGenerativeEncoder\b", inner.value):
            return True
    return False


def test_no_module_but_the_encoder_takes_a_generative_encoder():
    """The coupling rule: no module of grace_st or grace_training but grace_st.encoder takes a GenerativeEncoder as
    a parameter, so what the encoder hands its parts (the encode data path, saving and loading, the mteb identity)
    are plain values and no part calls back into it. Checked from the source in two ways:

    - no annotation outside grace_st.encoder (a parameter's, a return's, an annotated name's) names
      GenerativeEncoder, in any spelling (``GenerativeEncoder``, ``type[GenerativeEncoder]``, a string);
    - no module outside grace_st.encoder imports GenerativeEncoder (at module level, in a function, or for type
      checkers only) or reaches it as an attribute, except those in ENCODER_IMPORTERS, each for its stated reason.

    A module may still take a SentenceTransformer (the serving scheduler, the CLI, evaluation) and use its first
    module through the model; that is the entry points' business, not a part of the encoder."""
    annotated, imported = [], []
    for name, tree in modules().items():
        if name == "grace_st.encoder":
            continue
        found = [node for node in annotations(tree) if names_the_encoder(node)]
        annotated += [f"{name}:{node.lineno} {ast.unparse(node)}" for node in found]
        reaches = [
            node
            for node in ast.walk(tree)
            if isinstance(node, (ast.ImportFrom, ast.Attribute)) and names_the_encoder(node)
        ]
        if reaches and name not in ENCODER_IMPORTERS:
            imported.append(f"{name}:{reaches[0].lineno}")
    assert not annotated, annotated
    assert not imported, imported


def test_functions_stay_readable():
    too_long = []
    for name, tree in modules().items():
        for node in ast.walk(tree):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > MAX_FUNCTION_LINES:
                too_long.append(f"{name}.{node.name}: {lines} lines")
    assert not too_long
