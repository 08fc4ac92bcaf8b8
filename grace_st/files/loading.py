"""Loading a saved model without running code that came with it.

A model directory can carry Python in two places: ``modules.json`` may name a module class that
sentence-transformers imports from a ``.py`` file beside the weights, and a ``config.json`` (or
``tokenizer_config.json``) may hold an ``auto_map`` that points transformers at one. Both run only
under ``trust_remote_code=True``; sentence-transformers 6 asks for that flag to import *our*
module class too, so passing it blindly would open the door to everything else.

A name that merely starts with ``grace_st.`` is not enough: sentence-transformers hands any class
reference outside its own package to transformers' dynamic-module loader first, which reads
``grace_st.Evil`` as "class ``Evil`` of ``<model folder>/grace_st.py``" and
``grace_st.x--evil.Evil`` as "of ``grace_st.x/evil.py``", a folder resolved from the working
directory. So a reference is accepted only when it names exactly a class of the installed grace-st
or sentence-transformers package (:func:`module_class_problem`: resolved by importing from the
installed package, its file checked to lie inside that package's directory), with no ``--`` and
no ``.py`` file in the model folder that the dynamic loader could take instead.

:func:`load` is the one loading path of the CLI, the trainer and the benchmarks: it reads
``modules.json`` first and accepts only such classes, and no ``auto_map`` anywhere in the model,
unless the caller asks for remote code explicitly; only then does it give sentence-transformers the
flag its own class check needs. ``GenerativeEncoder.load`` never passes sentence-transformers' flag
on to transformers (``model_kwargs`` can). Nothing else in grace-st passes ``trust_remote_code=True``
(a test reads the source to keep it so).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import warnings
from pathlib import Path

# Module classes whose code is an installed, versioned package: never a file of the model.
OWN_MODULE_PACKAGES = ("grace_st.", "sentence_transformers.")
# Files in which transformers reads an ``auto_map`` (classes to import from the model's own .py files).
AUTO_MAP_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")


class RemoteCodeError(ValueError):
    """Loading this model would run Python shipped with it, and the caller did not ask for that."""


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None


def module_classes(directory: str | os.PathLike) -> list[tuple[str, str]]:
    """``(class reference, module sub-path)`` of each entry of ``directory/modules.json`` (empty
    without the file: a plain transformers model, which sentence-transformers wraps itself)."""
    path = Path(directory) / "modules.json"
    if not path.is_file():
        return []
    entries = _read_json(path)
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise ValueError(f"{path} is not a list of modules")
    classes = []
    for index, entry in enumerate(entries):
        reference, sub_path = entry.get("type"), entry.get("path", "")
        if not isinstance(reference, str) or not isinstance(sub_path, str):
            raise ValueError(f"{path}: module {index} has no class reference (`type`) or a non-text `path`")
        classes.append((reference, sub_path))
    return classes


def _package_dir(name: str) -> Path:
    """The directory of an installed package (imported: grace-st is running, and its loader needs
    sentence-transformers anyway)."""
    return Path(importlib.import_module(name).__file__).resolve().parent


def _inside(path: str | None, root: Path) -> bool:
    return bool(path) and Path(path).resolve().is_relative_to(root)


def module_class_problem(reference: str) -> str | None:
    """Why the ``modules.json`` class reference ``reference`` is not exactly a class of the installed
    grace-st or sentence-transformers package; None when it is.

    The module is located (:func:`importlib.util.find_spec`, which imports only its installed parent
    packages) and must be a file inside the package's directory before it is imported; the class it
    names must be defined in a file there too. ``--`` (transformers' "another repository's code")
    is refused outright, and so is a grace-st reference without a module (``grace_st.Name``), the
    shape transformers' dynamic loader reads as ``<model folder>/grace_st.py``.
    """
    if "--" in reference:
        return "a '--' reference, which makes transformers import code from another folder or repository"
    parts = reference.split(".")
    package = parts[0]
    if f"{package}." not in OWN_MODULE_PACKAGES or len(parts) < 2:
        return "not a class of the installed grace-st or sentence-transformers"
    if not all(part.isidentifier() for part in parts) or "__main__" in parts:
        return "not a dotted path of a module and a class"
    if package == "grace_st" and len(parts) < 3:
        return "grace-st's classes live in its modules (grace_st.encoder.GenerativeEncoder); transformers " \
               "would read this as a file grace_st.py in the model folder"
    module_name, class_name = ".".join(parts[:-1]), parts[-1]
    root = _package_dir(package)
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError, AttributeError):
        spec = None
    origin = spec.origin if spec is not None else None
    if spec is not None and origin is None and spec.loader is not None:
        # a module the package makes with a loader of its own (sentence-transformers' old module paths)
        origin = inspect.getfile(type(spec.loader))
    if not _inside(origin, root):
        return f"no module {module_name} in the installed package at {root}"
    try:
        with warnings.catch_warnings():  # sentence-transformers' old module paths warn, and still hold the class
            warnings.simplefilter("ignore", DeprecationWarning)
            found = getattr(importlib.import_module(module_name), class_name, None)
    except ImportError as error:  # an installed module whose optional dependency is missing
        return f"the installed {module_name} cannot be imported ({error})"
    if not isinstance(found, type):
        return f"the installed {module_name} has no class {class_name}"
    try:
        defined_in = inspect.getfile(found)
    except TypeError:
        defined_in = None
    if not _inside(defined_in, root):
        return f"{class_name} of {module_name} is not defined in the installed package at {root}"
    return None


def _shadowing_file(root: Path, reference: str) -> str | None:
    """A ``.py`` file in the model folder that transformers' dynamic loader could import in place of
    the installed class (it reads ``a.b.C`` as ``a.py`` or ``a.b.py`` beside the weights)."""
    parts = reference.split(".")
    for end in range(1, len(parts)):
        candidate = root / (".".join(parts[:end]) + ".py")
        if candidate.exists():
            return f"{candidate} could be imported in its place"
    return None


def remote_code(directory: str | os.PathLike) -> list[str]:
    """Every place in the model at ``directory`` that would make a loader import the model's own
    code: foreign module classes in ``modules.json`` and ``auto_map`` entries, each described
    with its file and what it names."""
    root = Path(directory)
    found, folders = [], [root]
    for reference, sub_path in module_classes(root):
        problem = module_class_problem(reference) or _shadowing_file(root, reference)
        if problem:
            found.append(f"{root / 'modules.json'} names the module class {reference!r} ({problem})")
        if sub_path:
            folders.append(root / sub_path)
    for folder in dict.fromkeys(folders):
        for name in AUTO_MAP_FILES:
            path = folder / name
            if path.is_file():
                content = _read_json(path)
                auto_map = content.get("auto_map") if isinstance(content, dict) else None
                if auto_map:
                    found.append(f"{path} has an auto_map to {json.dumps(auto_map, sort_keys=True)}")
    return found


def check_no_remote_code(directory: str | os.PathLike) -> None:
    """Raise :class:`RemoteCodeError` naming each file and class when loading ``directory`` would
    import code that ships with it."""
    found = remote_code(directory)
    if found:
        raise RemoteCodeError(
            f"loading {directory} would run Python code that ships with the model: "
            + "; ".join(found)
            + ". grace-st runs only classes of its installed package and of sentence-transformers. "
            "If you trust this model's code, "
            "pass trust_remote_code=True (`--trust-remote-code` on the command line)."
        )


def local_model_dir(model_name_or_path: str, *, revision: str | None = None, cache_folder: str | None = None) -> str:
    """A directory to inspect and load: the path itself, or a Hub id's snapshot in the cache."""
    from grace_st.files.hub import hub_snapshot, is_repo_id

    if os.path.isdir(model_name_or_path) or not is_repo_id(model_name_or_path):
        return model_name_or_path
    return hub_snapshot(model_name_or_path, revision, cache_dir=cache_folder, wanted_by="grace_st.load")


def load(
    model_name_or_path: str,
    *,
    trust_remote_code: bool = False,
    device: str | None = None,
    revision: str | None = None,
    cache_folder: str | None = None,
    model_kwargs: dict | None = None,
    **kwargs,
):
    """A ``SentenceTransformer`` from a directory or Hub id, with no code from the model run unless
    ``trust_remote_code`` (then it is passed to sentence-transformers and transformers alike).

    Without it, a foreign module class or an ``auto_map`` is a :class:`RemoteCodeError` naming the
    file, and sentence-transformers gets ``trust_remote_code=True`` only when ``modules.json``
    names a grace-st class (its check for any class outside its own package; nothing else in the
    model can use it, having been checked). Other keyword arguments go to ``SentenceTransformer``.
    """
    from sentence_transformers import SentenceTransformer

    path = local_model_dir(model_name_or_path, revision=revision, cache_folder=cache_folder)
    if not trust_remote_code:
        check_no_remote_code(path)
    ours = any(reference.startswith("grace_st.") for reference, _ in module_classes(path))
    model_kwargs = dict(model_kwargs or {})
    if trust_remote_code:  # GenerativeEncoder.load reads it here, for the model and the tokenizer
        model_kwargs.setdefault("trust_remote_code", True)
    extra = {"revision": revision} if path == model_name_or_path and revision else {}
    return SentenceTransformer(
        path,
        device=device,
        trust_remote_code=trust_remote_code or ours,
        cache_folder=cache_folder,
        model_kwargs=model_kwargs or None,
        **extra,
        **kwargs,
    )


def causal_lm_from_pretrained(path: str | os.PathLike, **kwargs):
    """``AutoModelForCausalLM.from_pretrained``, refusing weights that do not fit the config.

    transformers initialises any weight its config asks for and the checkpoint lacks (or holds in
    another shape) at random and only logs it: a foreign ``config.json`` beside our weights would
    give embeddings from a random network, of another width. Here that is an error naming the
    directory and the first weights concerned.
    """
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)
    except RuntimeError as error:
        if "ignore_mismatched_sizes" not in str(error):
            raise
        # transformers' own message points at a log table; say which files disagree
        raise ValueError(
            f"{path}: config.json and the weights do not belong together (weights of other shapes than the "
            "config gives them; transformers' log lists them). Restore the config.json saved with these weights."
        ) from None
    missing = list(info.get("missing_keys") or [])
    mismatched = [str(entry[0]) if isinstance(entry, (tuple, list)) else str(entry) for entry in info.get("mismatched_keys") or []]
    if missing or mismatched:
        problems = [f"{len(found)} {what}, e.g. {', '.join(sorted(found)[:3])}" for what, found in (
            ("weights the config asks for are not in the checkpoint", missing),
            ("weights have another shape than the config gives them", mismatched),
        ) if found]
        raise ValueError(
            f"{path}: config.json and the weights do not belong together ({'; '.join(problems)}); "
            "transformers would fill them with random values. Restore the config.json saved with these weights."
        )
    return model
