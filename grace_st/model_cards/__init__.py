"""The card every saved or pushed GRACE model carries (installed as ``grace_st.model_cards``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

TEMPLATE = Path(__file__).with_name("grace_model_card.md")
# The development scoreboard of the shipped models (the shipped models' cards) and the README's table of methods.
DEV_RESULTS = Path(__file__).with_name("dev_results.json")
TASKS = ("STS-B dev", "SICK-R trial", "SciFact", "Banking77", "MRPC val")


def results_table(results: dict | None = None) -> str:
    """The shipped models' dev scoreboard as markdown (``python -m grace_st.model_cards`` prints it; a test holds
    the README's copy to it). A row's mean is over the five tasks."""
    results = results or json.loads(DEV_RESULTS.read_text(encoding="utf-8"))
    lines = [
        "| model | thinks | " + " | ".join(TASKS) + " | mean | LM perplexity |",
        "|---|---|" + "---|" * (len(TASKS) + 2),
    ]
    for row in results["rows"]:
        scores = [row["scores"][task] for task in TASKS]
        mean = sum(scores) / len(scores)
        bold = "**" if row.get("shipped") else ""
        perplexity = "n/a" if row.get("perplexity") is None else f"{row['perplexity']:.1f}"
        lines.append(
            f"| {bold}{row['label']}{bold} | {row['thinks']} | "
            + " | ".join(f"{score:.3f}" for score in scores)
            + f" | {bold}{mean:.3f}{bold} | {perplexity} |"
        )
    return "\n".join(lines) + "\n"


def methods_table(results: dict | None = None) -> str:
    """One row a method as markdown: how it thinks, the shipped model, its mean dev score (the mean of its scoreboard
    row, named by label and thinks) and its cost a text by prompt type at its shipped budgets
    (``benchmarks/default_cost.py``, seconds a text; ``python -m grace_st.model_cards methods`` prints it; a test
    holds the README's copy to it)."""
    results = results or json.loads(DEV_RESULTS.read_text(encoding="utf-8"))
    rows = {(row["label"], row["thinks"]): row for row in results["rows"]}
    lines = [
        "| method | how it thinks | shipped model | mean dev score | s a text | s a query |",
        "|---|---|---|---|---|---|",
    ]
    for method in results["methods"]:
        row = rows[tuple(method["row"])]
        mean = sum(row["scores"][task] for task in TASKS) / len(TASKS)
        bold = "**" if row.get("shipped") else ""
        cost = method["cost"]
        lines.append(
            f"| {bold}{method['method']}{bold} | {method['how']} | {method['model']} | {bold}{mean:.3f}{bold} | "
            f"{cost['default']:.3f} | {cost['query']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def render_model_card(
    model,
    *,
    model_id: str = "path/to/model",
    name: str | None = None,
    base_model: str | None = None,
    license: str = "apache-2.0",
    example: dict[str, str] | None = None,
    training_config: dict[str, Any] | None = None,
    scores: dict[str, Any] | None = None,
    budget_choice: str | None = None,
    results: str | None = None,
) -> str:
    """Markdown with Hub metadata (library_name, pipeline_tag, tags, base_model) for a GRACE model.

    ``budget_choice``: why the rationale budgets are what they are (the measured curve), if known.
    ``results``: a markdown table of development scores beside other models (:func:`results_table`).
    """
    import jinja2

    __version__ = sys.modules["grace_st"].__version__  # the loaded package's: it imports this module, not the reverse

    encoder = model[0]
    config = {
        key: json.dumps(value) if isinstance(value, dict) else value for key, value in encoder.get_config_dict().items()
    }
    environment = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return environment.from_string(TEMPLATE.read_text(encoding="utf-8")).render(
        name=name or model_id.rstrip("/").split("/")[-1],
        model_id=model_id,
        base_model=base_model,
        license=license,
        dimension=encoder.get_embedding_dimension(),
        method=getattr(encoder, "method", "grace"),
        encoder_config=config,
        example=example,
        training_config=training_config,
        scores=scores,
        budget_choice=budget_choice,
        results=results,
        version=__version__,
    )


def write_model_card(model, directory: str | Path, **kwargs: Any) -> Path:
    path = Path(directory) / "README.md"
    path.write_text(render_model_card(model, **kwargs), encoding="utf-8")
    return path
