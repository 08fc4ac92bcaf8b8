"""A GRACE ``SentenceTransformer`` around any chat causal LM: the :class:`~grace_st.encoder.GenerativeEncoder`
and sentence-transformers' ``Normalize``, so similarity is cosine."""

from __future__ import annotations

from typing import Any

from .encoder import GenerativeEncoder


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
