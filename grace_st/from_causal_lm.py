"""A GRACE ``SentenceTransformer`` around any chat causal LM: the :class:`~grace_st.encoder.GenerativeEncoder`
and sentence-transformers' ``Normalize``, so similarity is cosine; and the GIRCSE authors' released adapters as
their reference code encodes with them."""

from __future__ import annotations

from typing import Any

from grace_st.encoder import GenerativeEncoder


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


# How GIRCSE's reference code (Roytsai27/GIRCSE) encodes: its prompt string tokenized with no special tokens, K = 3
# soft tokens (its evaluation's max_new_tokens), the formatted prompt cut at 512 tokens (its tokenizer call's
# max_length), and a corpus embedded bare (an empty instruction: the text alone).
GIRCSE_REFERENCE_SETTINGS: dict[str, Any] = {
    "method": "gircse",
    "prompt_format": "instruct",
    "max_rationale_tokens": 3,
    "max_input_tokens": 512,
}
GIRCSE_REFERENCE_INSTRUCTIONS: dict[str, str] = {
    "default": "Retrieve semantically similar text",
    "query": "Given a web search query, retrieve relevant passages that answer the query",
    "document": "",
}


def from_gircse_adapter(
    adapter: str,
    *,
    instructions: dict[str, str] | None = None,
    device: str | None = None,
    model_kwargs: dict[str, Any] | None = None,
    tokenizer_kwargs: dict[str, Any] | None = None,
    **encoder_config: Any,
):
    """One of the GIRCSE authors' released adapters (``Roytsai27/GIRCSE-QWEN7B``, ``Roytsai27/GIRCSE-Mistral7B``: PEFT
    LoRA folders on a base without a chat template) as a GIRCSE ``SentenceTransformer`` that encodes as their code
    does (:data:`GIRCSE_REFERENCE_SETTINGS`: ``Instruct: {instruction}\nQuery:{text}``, K = 3, prompts of at most 512
    tokens; :data:`GIRCSE_REFERENCE_INSTRUCTIONS`, the corpus embedded bare). ``instructions`` (by prompt type) and
    ``encoder_config`` override them; the base's tokenizer is used where the adapter has none. Saves and loads as
    any grace-st model."""
    config = {**GIRCSE_REFERENCE_SETTINGS, **encoder_config}
    config["instructions"] = {**GIRCSE_REFERENCE_INSTRUCTIONS, **(instructions or {})}
    return from_causal_lm(
        adapter, device=device, model_kwargs=model_kwargs, tokenizer_kwargs=tokenizer_kwargs, **config
    )
