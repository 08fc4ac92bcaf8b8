"""The card every saved or pushed GRACE model carries (installed as ``grace_st.model_cards``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TEMPLATE = Path(__file__).with_name("grace_model_card.md")


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
) -> str:
    """Markdown with Hub metadata (library_name, pipeline_tag, tags, base_model) for a GRACE model.

    ``budget_choice``: why the rationale budgets are what they are (the measured curve), if known.
    """
    import jinja2

    encoder = model[0]
    config = {key: json.dumps(value) if isinstance(value, dict) else value for key, value in encoder.get_config_dict().items()}
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
    )


def write_model_card(model, directory: str | Path, **kwargs: Any) -> Path:
    path = Path(directory) / "README.md"
    path.write_text(render_model_card(model, **kwargs), encoding="utf-8")
    return path
