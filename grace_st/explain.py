"""The rationale beside the embedding: what the model wrote about each text, and the vector
pooled over it (method.md §1)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from grace_st.methods.gircse import soft_token_trace  # noqa: F401 (GIRCSE's trace, where callers look for it)
from grace_st.methods.registry import METHODS
from grace_st.prompts import text_problem


def find_generative_encoder(model):
    """The model's first module that writes rationales (a GenerativeEncoder)."""
    for module in model.children():
        if hasattr(module, "decode_rationales"):
            return module
    raise TypeError(f"{type(model).__name__} has no GenerativeEncoder module: it writes no rationales")


def check_texts(texts) -> list[str]:
    """A list of strings, or a clear error naming the first bad item.

    A mapping, bytes or a non-iterable is refused as a whole: iterating them would embed a
    dict's keys or name a byte as an int.
    """
    if texts is None:
        raise TypeError("texts is None: pass a string or a list of strings")
    if isinstance(texts, str):
        texts = [texts]
    elif isinstance(texts, Mapping):
        raise TypeError(f"texts is a {type(texts).__name__}, not a string or a list of strings: {texts!r:.80}")
    elif isinstance(texts, (bytes, bytearray, memoryview)):
        raise TypeError(f"texts is {type(texts).__name__}: decode it to str first (e.g. data.decode('utf-8'))")
    elif not isinstance(texts, Iterable):
        raise TypeError(f"texts is {type(texts).__name__}, not a string or a list of strings: {texts!r:.80}")
    texts = list(texts)
    for index, text in enumerate(texts):
        problem = text_problem(text)
        if problem is not None:
            raise (TypeError if not isinstance(text, str) else ValueError)(f"texts[{index}] {problem}")
    return texts


def explain(model, texts, **encode_kwargs: Any) -> list[dict[str, Any]]:
    """Encode ``texts`` and return, per text, ``text``, ``rationale`` (exactly the text that was
    pooled), ``rationales`` (all of them when ``num_rationales`` > 1), ``truncated``,
    ``rationale_budget`` (the token limit this text got: ``max_rationale_tokens`` may differ
    by prompt type) and ``embedding`` — the vector ``model.encode(texts, **encode_kwargs)`` returns.
    A method's own trace adds its fields (:attr:`Method.trace <grace_st.methods.base.Method.trace>`): for a GIRCSE
    model (``method="gircse"``) ``soft_tokens``, for each of the K steps its five most probable tokens with their
    probabilities (the readable trace of s_k, gircse.md), where the "rationale" is each step's most probable token;
    None for a text answered from the rationale cache.

    Accepts ``encode``'s arguments (``prompt``, ``prompt_name``, ``task``, ``batch_size``,
    ``normalize_embeddings``, ``convert_to_tensor`` ...). ``encode_query``-style calls: pass
    ``task="query"`` or ``task="document"``.
    """
    texts = check_texts(texts)
    encoder = find_generative_encoder(model)
    if "output_value" in encode_kwargs:
        raise ValueError("explain() chooses output_value itself; call model.encode for other outputs")
    normalize = encode_kwargs.pop("normalize_embeddings", False)
    as_tensor = encode_kwargs.pop("convert_to_tensor", False)
    encode_kwargs.pop("convert_to_numpy", None)
    # output_value=None returns every feature sliced per text; the rationale ids are a
    # batch-first tensor so both sentence-transformers majors slice them the same way.
    items = model.encode(texts, output_value=None, **encode_kwargs)
    results = []
    for text, item in zip(texts, items):
        embedding = item["sentence_embedding"].detach().cpu()
        if normalize:
            embedding = torch.nn.functional.normalize(embedding, p=2, dim=0)
        rationales = encoder.decode_rationales(item["rationale_token_ids"])
        record = METHODS.get(getattr(encoder, "method", None))
        result = record.trace(encoder.tokenizer, item) if record is not None and record.trace is not None else {}
        results.append(
            {
                **result,
                "text": text,
                "rationale": rationales[0],
                "rationales": rationales,
                "truncated": bool(item["rationale_truncated"][0]),
                "rationale_budget": int(item["rationale_budget"]),
                "embedding": embedding if as_tensor else np.asarray(embedding.numpy()),
            }
        )
    return results
