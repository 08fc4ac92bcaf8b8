"""Run local and registered mteb tasks on one model; collect a JSON-ready report and a table."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def default_cache_dir() -> Path:
    """Where mteb's result cache goes by default: ``$GRACE_ST_HOME/mteb`` when that is set,
    otherwise ``<system temp dir>/grace_st_mteb``."""
    home = os.environ.get("GRACE_ST_HOME")
    if home:
        return Path(home).expanduser() / "mteb"
    return Path(tempfile.gettempdir()) / "grace_st_mteb"


def _clean(value: Any) -> Any:
    """JSON-safe copy: NaN and infinities become ``None`` (strict JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _clean(value.item())
    return value


def _scores_by_split(task_result) -> dict[str, dict[str, dict[str, Any]]]:
    """``{split: {hf_subset: {metric: value}}}`` from an mteb ``TaskResult``."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for split, entries in task_result.scores.items():
        for entry in entries:
            metrics = {k: v for k, v in entry.items() if k not in ("hf_subset", "languages", "mteb_version")}
            out.setdefault(split, {})[entry.get("hf_subset", "default")] = _clean(metrics)
    return out


def _main_score(task_result) -> float | None:
    values = [entry["main_score"] for entries in task_result.scores.values() for entry in entries]
    values = [float(v) for v in values if v is not None]
    return _clean(sum(values) / len(values)) if values else None


def _error_text(error: BaseException) -> str:
    """``"Type: first line of the message"`` (str(KeyError) would add quotes)."""
    message = error.args[0] if isinstance(error, KeyError) and error.args else error
    lines = str(message).strip().splitlines()
    text = lines[0] if lines else ""
    kind = type(error).__name__
    return text if text.startswith(f"{kind}:") else f"{kind}: {text}".rstrip(": ")


def _runnable(tasks: Sequence, task_names: Sequence[str]) -> list[tuple[Any, dict | None]]:
    """(task, None) for each task object, data loaded (a malformed local file fails here, before any
    generation), then for each registered name: (task, None), or (None, failure) when mteb does not
    know it."""
    import mteb

    runnable = [(task, None) for task in tasks]
    for task in tasks:
        task.load_data()
    for name in task_names:
        try:
            runnable.append((mteb.get_task(name), None))
        except Exception as error:  # noqa: BLE001 -- an unknown name or a failed lookup is reported, not fatal
            runnable.append((None, {"name": name, "error": _error_text(error)}))
    if not runnable:
        raise ValueError("nothing to evaluate: give local tasks or registered task names")
    return runnable


def _task_of_prompt(name: str) -> str:
    """The task a prompt name keys (mteb's ``"<task>"``, ``"<task>-query"``, ``"<task>-document"``)."""
    for suffix in ("-query", "-document"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def mteb_wrapper(model, tasks: Sequence = ()):
    """``model`` (a SentenceTransformer) as mteb's ``SentenceTransformerEncoderWrapper`` wraps it for
    ``mteb.evaluate``, keeping the prompts ``model.prompts`` holds for ``tasks`` by name (``"<name>"``,
    ``"<name>-query"``, ``"<name>-document"``). mteb keeps only prompts keyed by names it knows (its registry's tasks,
    task types, prompt types) and drops, with a warning, those of the local tasks, whose own instruction would then
    not be used. The prompt a call gets is mteb's choice among them: the task's for its prompt type, the task's, its
    type's, the prompt type's (the GenerativeEncoder's query or document instruction)."""
    from mteb.models import SentenceTransformerEncoderWrapper

    names = {task.metadata.name for task in tasks}
    prompts = getattr(model, "prompts", None)
    if not isinstance(prompts, dict):
        return SentenceTransformerEncoderWrapper(model)
    everything = dict(prompts)
    own = {name: text for name, text in everything.items() if _task_of_prompt(name) in names}
    for name in own:  # out of sight of mteb's check, which would warn that they are ignored
        del prompts[name]
    try:
        wrapped = SentenceTransformerEncoderWrapper(model)
    finally:
        prompts.clear()
        prompts.update(everything)
    if own:
        wrapped.model_prompts = {**(wrapped.model_prompts or {}), **own}
    return wrapped


def run_evaluation(
    model,
    tasks: Sequence = (),
    task_names: Sequence[str] = (),
    *,
    batch_size: int = 32,
    cache_dir: str | os.PathLike | None = None,
    overwrite_strategy: str = "always",
    show_progress_bar: bool = True,
) -> dict[str, Any]:
    """Evaluate ``model`` on mteb task objects (e.g. the local tasks) and registered task names.

    Local data is loaded first (a malformed file raises before any encoding); then each task runs
    in its own ``mteb.evaluate`` call, so one that fails (an unknown name, a registered task whose
    data cannot be downloaded offline) is reported with its reason and the others' results kept.

    ``overwrite_strategy="always"`` by default because mteb keys its cache by model name and
    revision, which a locally changed model does not change: mteb's default
    (``"only-missing"``) would silently return the previous model's scores.

    A task's own instruction in ``model.prompts`` (keyed by its name, or ``"<name>-query"`` / ``"<name>-document"``)
    is used for it, local tasks included (:func:`mteb_wrapper`).

    Returns a JSON-ready dict: ``model`` (``name``, ``revision`` as mteb reports them),
    ``mteb_version``, ``cache_dir``, ``encoder`` (the GenerativeEncoder settings, if any) and
    ``tasks``: one entry per task in order, with ``name``, ``type``, ``main_metric``,
    ``main_score``, ``scores`` (``{split: {subset: {metric: value}}}``), ``evaluation_time``
    and ``error`` (``None`` on success).
    """
    import mteb
    from sentence_transformers import SentenceTransformer
    from tqdm.auto import tqdm

    runnable = _runnable(tasks, task_names)
    entries: list[dict[str, Any]] = []
    evaluated = [task for task, _ in runnable if task is not None]
    wrapped = mteb_wrapper(model, evaluated) if isinstance(model, SentenceTransformer) else model
    model_name, model_revision = wrapped.mteb_model_meta.name, wrapped.mteb_model_meta.revision
    cache_path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    encode_kwargs = {"batch_size": batch_size, "show_progress_bar": show_progress_bar}
    run = {"encode_kwargs": encode_kwargs, "cache": mteb.ResultCache(cache_path),
           "overwrite_strategy": overwrite_strategy, "show_progress_bar": show_progress_bar}

    progress = tqdm(runnable, desc="Evaluating", unit="task", disable=not show_progress_bar)
    for task, failure in progress:
        if task is None:
            entries.append({**_empty_entry(failure["name"], None, None), "error": failure["error"]})
            continue
        progress.set_description(f"Evaluating {task.metadata.name}")
        entry, named = _evaluate_task(wrapped, task, **run)
        model_name, model_revision = named or (model_name, model_revision)
        entries.append(entry)

    encoder = model[0] if isinstance(model, SentenceTransformer) and len(model) else None
    settings = _clean(encoder.get_config_dict()) if hasattr(encoder, "get_config_dict") else None
    return {"model": {"name": model_name, "revision": model_revision}, "mteb_version": mteb.__version__,
            "cache_dir": str(cache_path), "encoder": settings, "tasks": entries}


def _evaluate_task(wrapped, task, *, encode_kwargs, cache, overwrite_strategy, show_progress_bar):
    """One task's report entry, and the (name, revision) mteb filed it under (None when it failed)."""
    import mteb

    entry = _empty_entry(task.metadata.name, task.metadata.type, task.metadata.main_score)
    try:
        result = mteb.evaluate(
            wrapped,
            task,
            encode_kwargs=dict(encode_kwargs),
            cache=cache,
            overwrite_strategy=overwrite_strategy,
            co2_tracker=False,
            show_progress_bar=show_progress_bar,
            raise_error=True,
        )
    except Exception as error:  # noqa: BLE001 -- one failing task must not lose the others' results
        entry["error"] = _error_text(error)
        return entry, None
    if result.exceptions:
        entry["error"] = "; ".join(e.exception for e in result.exceptions)
    for task_result in result.task_results:
        entry.update(
            main_score=_main_score(task_result),
            scores=_scores_by_split(task_result),
            evaluation_time=_clean(task_result.evaluation_time),
        )
    return entry, (result.model_name, result.model_revision)


def _empty_entry(name: str, task_type: str | None, main_metric: str | None) -> dict[str, Any]:
    return {
        "name": name,
        "type": task_type,
        "main_metric": main_metric,
        "main_score": None,
        "scores": {},
        "evaluation_time": None,
        "error": None,
    }


def format_table(report: dict[str, Any]) -> str:
    """Plain-text table: task, type, main metric, score (``failed`` rows list their reason below)."""
    header = ("task", "type", "main metric", "score")
    rows = []
    for entry in report["tasks"]:
        if entry["error"]:
            score = "failed"
        elif entry["main_score"] is None:
            score = "n/a"
        else:
            score = f"{entry['main_score']:.4f}"
        rows.append((entry["name"], entry["type"] or "?", entry["main_metric"] or "?", score))
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        f"model: {report['model']['name']} (revision {report['model']['revision']})",
        "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    failures = [entry for entry in report["tasks"] if entry["error"]]
    if failures:
        lines.append("")
        lines += [f"failed: {entry['name']}: {entry['error']}" for entry in failures]
    return "\n".join(lines)
