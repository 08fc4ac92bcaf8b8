"""grace-st: generative embeddings (GRACE) as a sentence-transformers model.

A causal LM writes a rationale about a text, then its own hidden states over the
instruction-wrapped text and the rationale are mean-pooled into the embedding
(``docs/method.md`` §1, Eqs. 1–3).
"""

from __future__ import annotations

from typing import Any

from .default_model import default_model_path
from .encoder import GenerativeEncoder
from .explain import explain
from .loading import load
from .prompts import DEFAULT_INSTRUCTIONS

__version__ = "0.3.0"
__all__ = ["DEFAULT_INSTRUCTIONS", "GenerativeEncoder", "default_model_path", "explain", "from_causal_lm", "load"]


def from_causal_lm(
    model_name_or_path: str | None = None,
    *,
    device: str | None = None,
    model=None,
    tokenizer=None,
    model_kwargs: dict[str, Any] | None = None,
    tokenizer_kwargs: dict[str, Any] | None = None,
    **encoder_config: Any,
):
    """A GRACE ``SentenceTransformer`` (GenerativeEncoder + Normalize) around any chat causal LM.

    ``encoder_config`` takes GenerativeEncoder's settings (``max_rationale_tokens``,
    ``instructions``, ``do_sample`` ...). Embeddings are L2-normalised; similarity is cosine.
    """
    from sentence_transformers import SentenceTransformer

    try:
        from sentence_transformers.base.modules import Normalize
    except ImportError:
        from sentence_transformers.models import Normalize

    encoder = GenerativeEncoder(
        model_name_or_path,
        model=model,
        tokenizer=tokenizer,
        model_kwargs=model_kwargs,
        tokenizer_kwargs=tokenizer_kwargs,
        **encoder_config,
    )
    return SentenceTransformer(modules=[encoder, Normalize()], device=device, similarity_fn_name="cosine")
